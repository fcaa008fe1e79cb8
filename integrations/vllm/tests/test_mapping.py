"""Unit tests of the vLLM -> attnhub mapping (no vLLM needed)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from attnhub_vllm.mapping import (
    AttnhubConfigurationError,
    batch_from_common,
    cache_pages,
    cache_planes,
    cache_views,
    checks_from_additional_config,
    choice_from_additional_config,
    decode_batch,
    extra_kv_bytes,
    latent_cache,
    mla_layout_refusal,
    mla_spec_from_vllm,
    prefill_context_sources,
    refuse_split_prefill_context,
    spec_from_vllm,
)

import attnhub
from attnhub import BatchMetadata, PagedKVCache


def _common(query_lens, seq_lens, block_size, width=8, pad_reqs=2, pad_tokens=3):
    """A CommonAttentionMetadata look-alike over persistent buffers longer than the batch,
    as vLLM's model runner passes them."""
    ref = BatchMetadata.from_lengths(
        query_lens,
        seq_lens,
        torch.arange(len(query_lens) * width, dtype=torch.int32).view(-1, width),
        block_size,
    )
    n = ref.num_reqs
    qsl = torch.cat([ref.query_start_loc_cpu, ref.query_start_loc_cpu[-1:].repeat(pad_reqs)])
    seq = torch.cat([ref.seq_lens_cpu, torch.zeros(pad_reqs, dtype=torch.int32)])
    table = torch.cat([ref.block_table, torch.zeros(pad_reqs, width, dtype=torch.int32)])
    slots = torch.cat([ref.slot_mapping, torch.full((pad_tokens,), -1)])
    cm = SimpleNamespace(
        query_start_loc=qsl.clone(),
        query_start_loc_cpu=qsl,
        seq_lens=seq,
        num_reqs=n,
        num_actual_tokens=ref.num_actual_tokens + pad_tokens,
        max_query_len=ref.max_query_len,
        max_seq_len=ref.max_seq_len + 7,  # vLLM: "may be an upper bound"
        block_table_tensor=table,
        slot_mapping=slots,
        causal=True,
    )
    return cm, ref


def test_batch_from_common_matches_from_lengths() -> None:
    q, s = [1, 1, 7, 30], [9, 40, 7, 95]  # decodes, a prefill, a chunked prefill
    cm, ref = _common(q, s, block_size=16)
    batch = batch_from_common(cm, 16)
    batch.validate()
    for name in ("query_start_loc_cpu", "seq_lens_cpu", "block_table"):
        assert torch.equal(getattr(batch, name), getattr(ref, name)), name
    assert torch.equal(batch.slot_mapping[: ref.num_actual_tokens], ref.slot_mapping)
    assert (batch.slot_mapping[ref.num_actual_tokens :] == -1).all()
    assert (batch.num_reqs, batch.num_actual_tokens) == (4, sum(q))
    assert (batch.max_query_len, batch.max_seq_len) == (30, 95)  # exact, not vLLM's bound


def test_batch_from_common_shares_vllm_tensors() -> None:
    """No copies: the batch's device tensors are views of vLLM's buffers."""
    cm, _ = _common([1, 5], [3, 5], block_size=16)
    batch = batch_from_common(cm, 16)
    assert batch.block_table.data_ptr() == cm.block_table_tensor.data_ptr()
    assert batch.slot_mapping is cm.slot_mapping
    assert batch.seq_lens.data_ptr() == cm.seq_lens.data_ptr()
    # on the CPU platform the tensors are host data: no host copies are made
    assert batch.block_table_cpu is None and batch.slot_mapping_cpu is None


def test_batch_from_common_refuses_tensor_causal() -> None:
    cm, _ = _common([1], [3], block_size=16)
    cm.causal = torch.ones(1, dtype=torch.bool)
    with pytest.raises(AttnhubConfigurationError, match="causal"):
        batch_from_common(cm, 16)


def test_batch_from_common_hands_over_vllms_exact_maxima() -> None:
    """With ``exact_maxima`` (no speculative decoding: vLLM's maxima come from the same host
    arrays) the batch takes vLLM's max_query_len / max_seq_len as they are, tokens still from
    query_start_loc (vLLM's count may include padding rows), and no slice is made of buffers
    already the batch's size."""
    q, s = [1, 1, 7, 30], [9, 40, 7, 95]
    cm, ref = _common(q, s, block_size=16, pad_reqs=0)
    cm.max_seq_len = ref.max_seq_len  # exact, as vLLM's without speculative decoding
    batch = batch_from_common(cm, 16, exact_maxima=True)
    batch.validate()
    assert (batch.max_query_len, batch.max_seq_len, batch.num_actual_tokens) == (30, 95, 39)
    assert batch.query_start_loc_cpu is cm.query_start_loc_cpu and batch.seq_lens is cm.seq_lens
    assert batch.block_table is cm.block_table_tensor


def test_a_wrong_maximum_vllm_hands_over_is_refused_by_build_naming_it() -> None:
    """vLLM's maxima are checked once, by attnhub's ``build``: an optimistic max_seq_len (as
    speculative decoding gives) is refused with a typed error, before any cache is touched."""
    cm, _ = _common([1, 1, 7, 30], [9, 40, 7, 95], block_size=16)  # max_seq_len: 95 + 7
    batch = batch_from_common(cm, 16, exact_maxima=True)
    assert batch.max_seq_len == 102
    backend = attnhub.select_backend(
        attnhub.AttentionSpec(
            num_heads=4, num_kv_heads=2, head_size=8, dtype=torch.float32, block_size=16
        ),
        prefer="torch",
    )
    with pytest.raises(attnhub.errors.InvalidInputError, match="max_seq_len = 102"):
        backend.metadata_builder().build(batch)
    assert batch_from_common(cm, 16).max_seq_len == 95  # without it: reduced, exact


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cache_views_address_vllm_packed_pages(layout: str) -> None:
    """K goes to [..., :D] and V to [..., D:] of vLLM's [B, H, N, 2D] page, at the slot's
    block and offset, whatever the attnhub layout."""
    spec, _ = spec_from_vllm(
        num_heads=4, num_kv_heads=2, head_size=8, dtype=torch.float32, block_size=4, scale=0.3
    )
    assert spec is not None
    kv = torch.zeros(3, 2, 4, 16)  # [B, H, N, 2D]
    cache = cache_views(kv, spec, layout)
    k = torch.randn(2, 2, 8)
    v = torch.randn(2, 2, 8)
    backend = attnhub.select_backend(spec, prefer="torch")
    # torch declares NHD; write through the generic index path to check addressing only
    if layout == backend.capabilities.kv_cache_layout:
        backend.impl().write_kv(k, v, cache, torch.tensor([5, 11]))
        assert torch.equal(kv[1, :, 1, :8], k[0]) and torch.equal(kv[1, :, 1, 8:], v[0])
        assert torch.equal(kv[2, :, 3, :8], k[1]) and torch.equal(kv[2, :, 3, 8:], v[1])
        assert kv.count_nonzero() == 2 * 2 * 2 * 8
    keyv = cache.key
    assert keyv.data_ptr() == kv.data_ptr()  # a view, no copy
    assert tuple(keyv.shape) == ((3, 4, 2, 8) if layout == "NHD" else (3, 2, 4, 8))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cache_planes_carve_contiguous_planes_from_vllm_memory(layout: str) -> None:
    """For backends that need contiguous planes: keys in the first half of the layer tensor's
    memory, values in the second, no copy; a write through them lands in vLLM's tensor and
    reads back as written. A non-contiguous tensor gets None."""
    spec, _ = spec_from_vllm(
        num_heads=4, num_kv_heads=2, head_size=8, dtype=torch.float32, block_size=4, scale=0.3
    )
    assert spec is not None
    gappy = torch.zeros(3, 2, 4, 32)[..., :16]
    assert cache_planes(gappy, spec, layout) is None  # not one dense run: no planes to carve
    kv = torch.zeros(3, 4, 2, 16).permute(0, 2, 1, 3)  # vLLM's [B, H, N, 2D] over NHD memory
    cache = cache_planes(kv, spec, layout)
    assert cache is not None
    assert cache.key.is_contiguous() and cache.value.is_contiguous()
    assert cache.key.data_ptr() == kv.data_ptr()
    assert cache.value.data_ptr() == kv.data_ptr() + kv.numel() // 2 * kv.element_size()
    assert tuple(cache.key.shape) == ((3, 4, 2, 8) if layout == "NHD" else (3, 2, 4, 8))
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    slots = torch.tensor([5, 11])
    attnhub.reference.write_kv(cache, k, v, slots)
    got_k, got_v = attnhub.reference.read_sequence(cache, torch.tensor([1, 2]), 8)
    assert torch.equal(got_k[[1, 7]].double(), k.double())
    assert torch.equal(got_v[[1, 7]].double(), v.double())
    assert kv.count_nonzero() == 2 * 2 * 2 * 8  # only the written slots changed
    assert extra_kv_bytes(cache, kv) == 0


def test_cache_pages_are_vllms_blocks_in_memory() -> None:
    """Row b of the pages is the memory of vLLM's block b, whatever order vLLM laid its heads,
    slots and channels out in (LBHNC, LBNHC); None where a block's memory is not one run."""
    spec, _ = spec_from_vllm(
        num_heads=4, num_kv_heads=2, head_size=8, dtype=torch.float32, block_size=4, scale=0.3
    )
    assert spec is not None
    for kv in (torch.zeros(3, 2, 4, 16), torch.zeros(3, 4, 2, 16).permute(0, 2, 1, 3)):
        pages = cache_pages(kv, spec)
        assert pages is not None and tuple(pages.shape) == (3, 2 * 4 * 2 * 8)
        for b in range(3):
            assert pages[b].data_ptr() == kv[b].data_ptr()
        pages[1].fill_(1.0)  # the same memory: exactly block 1 changes
        assert kv[1].eq(1).all() and kv.count_nonzero() == kv[1].numel()
    assert cache_pages(torch.zeros(3, 2, 4, 32)[..., :16], spec) is None  # gaps in a block
    assert cache_pages(torch.zeros(2, 3, 4, 16).transpose(0, 1), spec) is None  # blocks inner
    # Backends without a page layout of their own keep the adapter's views (default None).
    backend = attnhub.select_backend(spec, prefer="torch")
    assert backend.kv_cache_from_pages(cache_pages(torch.zeros(3, 2, 4, 16), spec)) is None


def _cpu_backend(spec: attnhub.AttentionSpec) -> attnhub.AttentionBackend:
    try:
        cls = attnhub.get_backend("cpu")
    except attnhub.errors.AttnhubError as exc:
        pytest.skip(f"attnhub's cpu backend is not installed: {exc}")
    why = cls.availability("cpu")
    if why is not None:
        pytest.skip(f"attnhub's cpu backend is unavailable: {why}")
    return cls(spec)


def test_cpu_backend_keeps_vllms_cpu_block_layout_in_the_pages() -> None:
    """The cpu backend's cache in vLLM's pages is the kernels' storage, as vLLM's CPU_ATTN
    views the same tensor ([B, H, 2N, D], keys then values): a write through attnhub leaves
    exactly the bytes vLLM's own call leaves, the attention gives the bits it gives over the
    backend's own cache, and no byte lies outside vLLM's tensor."""
    spec = attnhub.AttentionSpec(
        num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32, block_size=32
    )
    backend = _cpu_backend(spec)
    kv = torch.zeros(5, 2, 32, 128)  # vLLM's LBHNC per-layer tensor
    pages = cache_pages(kv, spec)
    assert pages is not None
    cache = backend.kv_cache_from_pages(pages)
    assert cache is not None and extra_kv_bytes(cache, kv) == 0
    from attnhub_cpu.backend import is_kernel_storage

    assert is_kernel_storage(cache)
    gen = torch.Generator().manual_seed(0)
    batch = BatchMetadata.from_lengths([1, 3], [40, 3], [[4, 1], [2, 0]], 32)
    n = batch.num_actual_tokens
    q = torch.randn(n, 4, 64, generator=gen)
    k, v = torch.randn(n, 2, 64, generator=gen), torch.randn(n, 2, 64, generator=gen)
    history = torch.randn(5, 2, 32, 128, generator=gen)  # earlier tokens, in vLLM's page bytes
    kv.copy_(history)
    impl = backend.impl()
    meta = backend.metadata_builder().build(batch)
    out = impl.forward(q, k, v, cache, meta)
    theirs = history.clone().view(5, 2, 64, 64)  # vLLM's CPU_ATTN views its tensor so
    k_cache, v_cache = theirs.chunk(2, dim=2)
    torch.ops._C.cpu_attn_reshape_and_cache(
        k, v, k_cache, v_cache, batch.slot_mapping.to(torch.int64), backend.isa, 1.0, 1.0, "auto"
    )
    assert torch.equal(kv, theirs.view_as(kv))
    own = backend.allocate_kv_cache(5)  # the same K/V in the backend's own storage
    own.key.copy_(cache.key)
    own.value.copy_(cache.value)
    assert torch.equal(impl.forward(q, None, None, own, meta), out)


def test_cpu_backend_refuses_pages_it_cannot_lay_out() -> None:
    spec = attnhub.AttentionSpec(
        num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32, block_size=32
    )
    backend = _cpu_backend(spec)
    page = 2 * 2 * 32 * 64
    bad = {
        "must be \\[num_blocks, 8192\\]": torch.zeros(3, page + 1),
        "float16": torch.zeros(3, page, dtype=torch.float16),
        "dense": torch.zeros(3, 2 * page)[:, ::2],
        "overlap": torch.zeros(4 * page).as_strided((3, page), (page // 2, 1)),
    }
    for match, pages in bad.items():
        with pytest.raises(attnhub.errors.InvalidInputError, match=match):
            backend.kv_cache_from_pages(pages)


def test_extra_kv_bytes_counts_only_memory_outside_vllms_tensor() -> None:
    spec, _ = spec_from_vllm(
        num_heads=4, num_kv_heads=2, head_size=8, dtype=torch.float32, block_size=4, scale=0.3
    )
    assert spec is not None
    kv = torch.zeros(3, 2, 4, 16)
    assert extra_kv_bytes(cache_views(kv, spec, "NHD"), kv) == 0  # strided views
    own = PagedKVCache.for_spec(spec, 3, "cpu")
    assert extra_kv_bytes(own, kv) == 2 * 3 * 4 * 2 * 8 * 4  # two planes of float32


@pytest.mark.parametrize(
    ("vllm_dtype", "fp8"), [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)]
)
@pytest.mark.parametrize("carve", [False, True])
def test_fp8_caches_view_vllm_bytes_with_the_layer_scales(
    vllm_dtype: str, fp8: torch.dtype, carve: bool
) -> None:
    """vLLM allocates fp8 caches as uint8 and keeps per-layer scales: the views are fp8 over
    the same bytes and carry those very scale tensors, so a write stores fp8(x / scale) in
    vLLM's tensor, and reading back dequantizes with the scale."""
    spec, reasons = spec_from_vllm(
        num_heads=4,
        num_kv_heads=2,
        head_size=8,
        dtype=torch.bfloat16,
        block_size=4,
        scale=0.3,
        kv_cache_dtype=vllm_dtype,
    )
    assert spec is not None, reasons
    kv = torch.zeros(3, 4, 2, 16, dtype=torch.uint8).permute(0, 2, 1, 3)  # [B, H, N, 2D]
    k_scale, v_scale = torch.tensor(0.5), torch.tensor(2.0)
    views = cache_planes if carve else cache_views
    cache = views(kv, spec, "NHD", (k_scale, v_scale))
    assert cache is not None
    assert cache.key.dtype == fp8 and cache.key.untyped_storage().data_ptr() == kv.data_ptr()
    assert cache.key_scale is k_scale and cache.value_scale is v_scale
    k = torch.randn(2, 2, 8).to(torch.bfloat16)
    v = torch.randn(2, 2, 8).to(torch.bfloat16)
    backend = attnhub.select_backend(spec, prefer="torch")
    backend.impl().write_kv(k, v, cache, torch.tensor([5, 11]))
    expected = PagedKVCache.allocate(
        3, 4, 2, 8, torch.bfloat16, layout="NHD", kv_cache_dtype=spec.kv_cache_dtype
    )
    expected = dataclasses.replace(expected, key_scale=k_scale, value_scale=v_scale)
    attnhub.reference.write_kv(expected, k, v, torch.tensor([5, 11]))
    assert torch.equal(cache.key.view(torch.uint8), expected.key.view(torch.uint8))
    assert torch.equal(cache.value.view(torch.uint8), expected.value.view(torch.uint8))
    assert kv.count_nonzero() > 0  # the bytes live in vLLM's tensor


def test_spec_from_vllm_maps_and_refuses() -> None:
    spec, reasons = spec_from_vllm(
        num_heads=8,
        num_kv_heads=2,
        head_size=32,
        dtype=torch.bfloat16,
        block_size=128,
        scale=0.1,
        sliding_window=64,
        logits_soft_cap=0,  # vLLM's "none"
    )
    assert reasons == [] and spec is not None
    assert (spec.sliding_window, spec.logits_soft_cap, spec.scale) == (64, None, 0.1)
    for vllm_name, ours in (
        ("fp8", "fp8_e4m3"),
        ("fp8_e4m3", "fp8_e4m3"),
        ("fp8_e5m2", "fp8_e5m2"),
    ):
        spec, _ = spec_from_vllm(
            num_heads=8,
            num_kv_heads=2,
            head_size=32,
            dtype=torch.bfloat16,
            block_size=128,
            scale=0.1,
            kv_cache_dtype=vllm_name,
        )
        assert spec is not None and spec.kv_cache_dtype == ours
    spec, reasons = spec_from_vllm(
        num_heads=8,
        num_kv_heads=2,
        head_size=32,
        dtype=torch.bfloat16,
        block_size=128,
        scale=0.1,
        kv_cache_dtype="fp8_inc",
        attn_type="encoder_decoder",
    )
    assert spec is None
    assert any("kv_cache_dtype 'fp8_inc'" in r for r in reasons)
    assert any("'encoder_decoder' is not mapped" in r for r in reasons)


def test_backend_choice_from_vllm_additional_config() -> None:
    assert choice_from_additional_config({}) == (None, False)
    assert choice_from_additional_config({"other_plugin": 1}) == (None, False)
    assert choice_from_additional_config({"attnhub": {"backend": "ascend", "emulate": True}}) == (
        "ascend",
        True,
    )
    assert choice_from_additional_config({"attnhub": {"backend": "torch"}}) == ("torch", False)
    for bad, named in (
        ({"attnhub": "ascend"}, "must be a dict"),
        ({"attnhub": {"backends": "ascend"}}, "unknown key 'backends'"),
        ({"attnhub": {"emulate": "yes"}}, "['emulate'] = 'yes' must be a bool"),
    ):
        with pytest.raises(AttnhubConfigurationError, match=None) as info:
            choice_from_additional_config(bad)
        assert named in str(info.value)


def test_step_checks_from_vllm_additional_config() -> None:
    """Full step checks unless the config asks for structural ones (an engine that builds each
    step itself may), and nothing else."""
    assert checks_from_additional_config({}) == "full"
    assert checks_from_additional_config({"attnhub": {"backend": "torch"}}) == "full"
    assert checks_from_additional_config({"attnhub": {"checks": "structural"}}) == "structural"
    for bad, named in (
        ({"attnhub": {"checks": "none"}}, "['checks'] = 'none' must be one of 'full'"),
        ({"attnhub": {"checks": False}}, "['checks'] = False must be a str"),
    ):
        with pytest.raises(AttnhubConfigurationError) as info:
            checks_from_additional_config(bad)
        assert named in str(info.value)


# --- MLA layers ---------------------------------------------------------------------------------

#: The tiny DeepSeek-V2's MLA layer as vLLM's MLAAttention describes it (vllm_generate.py).
MLA_LAYER = dict(
    num_heads=4,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
    dtype=torch.float32,
    block_size=16,
    scale=96**-0.5,
)


def test_mla_spec_from_vllm_maps_an_mla_layer() -> None:
    spec, reasons = mla_spec_from_vllm(**MLA_LAYER, kv_cache_dtype="float16")
    assert reasons == [] and spec is not None
    assert (spec.num_heads, spec.latent_size, spec.qk_head_dim) == (4, 576, 96)
    assert spec.scale == 96**-0.5 and spec.kv_cache_dtype == "auto"


@pytest.mark.parametrize(
    ("vllm_dtype", "latent"),
    [("fp8", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2"), ("auto", "auto")],
)
def test_mla_spec_from_vllm_maps_fp8_latent_caches(vllm_dtype: str, latent: str) -> None:
    """vLLM's fp8 kv cache dtypes become attnhub's fp8 latents (one per-layer scale)."""
    spec, reasons = mla_spec_from_vllm(**MLA_LAYER, kv_cache_dtype=vllm_dtype)
    assert reasons == [] and spec is not None and spec.kv_cache_dtype == latent


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"kv_cache_dtype": "fp8_inc"}, "kv_cache_dtype 'fp8_inc'"),
        ({"kv_cache_dtype": "fp8_ds_mla"}, "kv_cache_dtype 'fp8_ds_mla'"),
        ({"sliding_window": 128}, "sliding_window 128"),
        ({"logits_soft_cap": 30.0}, "logits_soft_cap 30.0"),
        ({"use_alibi": True}, "ALiBi"),
        ({"attn_type": "encoder_only"}, "'encoder_only'"),
        ({"block_size": 0}, "block_size = 0"),
    ],
)
def test_mla_spec_from_vllm_refuses_what_it_does_not_map_naming_it(extra: dict, named: str) -> None:
    spec, reasons = mla_spec_from_vllm(**(MLA_LAYER | extra))
    assert spec is None and len(reasons) == 1 and named in reasons[0], reasons


def test_decode_batch_is_the_steps_decode_requests_and_their_slots() -> None:
    """vLLM's MLA builder puts decodes first; forward_mqa attends for them alone."""
    cm, ref = _common([1, 1, 7, 30], [9, 40, 7, 95], block_size=16)
    batch = decode_batch(cm, 16, num_decodes=2, num_decode_tokens=2)
    batch.validate()
    assert (batch.num_reqs, batch.num_actual_tokens, batch.num_tokens) == (2, 2, 2)
    assert torch.equal(batch.seq_lens_cpu, ref.seq_lens_cpu[:2])
    assert torch.equal(batch.block_table, ref.block_table[:2])
    assert torch.equal(batch.slot_mapping, ref.slot_mapping[:2])
    assert batch.slot_mapping.data_ptr() == cm.slot_mapping.data_ptr()  # a view, no copy


def test_latent_cache_is_vllms_joint_plane_itself() -> None:
    """Written through attnhub, read in vLLM's tensor: the same memory, no byte beside it."""
    from attnhub.mla import MLASpec, write_latent_kv

    spec = MLASpec(**MLA_LAYER)
    plane = torch.zeros(3, 16, 576)  # vLLM's MLA kv_cache of one layer
    cache = latent_cache(plane, spec)
    assert cache.layout == "joint" and extra_kv_bytes(cache, plane) == 0
    kv_c, k_pe = torch.randn(2, 512), torch.randn(2, 64)
    write_latent_kv(spec, cache, kv_c, k_pe, torch.tensor([5, 33]))
    assert torch.equal(plane[0, 5], torch.cat([kv_c[0], k_pe[0]]))
    assert torch.equal(plane[2, 1], torch.cat([kv_c[1], k_pe[1]]))
    own = latent_cache(torch.zeros(3, 16, 576), spec)  # another plane: counted once
    assert extra_kv_bytes(own, plane) == 3 * 16 * 576 * 4


def test_mla_backends_reading_split_planes_only_need_an_engine_without_prefill_context() -> None:
    """vLLM's own prefill reads a prefill's cached context from the joint plane: a backend
    reading split planes only is served in place exactly when the engine config gives no
    prefill cached context (``[]``); otherwise (or the config unknown) refused, naming the
    backend, its layouts and what in the config gives a prefill context."""
    for context in (None, [], ["chunked prefill is on"]):
        assert mla_layout_refusal("torch", ("joint", "split"), context) is None
    assert mla_layout_refusal("npu", ("split",), []) is None
    why = mla_layout_refusal("npu", ("split",), ["prefix caching is on (...)", "another"])
    assert why is not None and "'npu' reads latent layouts split only" in why
    assert "prefix caching is on (...); another" in why
    unknown = mla_layout_refusal("npu", ("split",))
    assert unknown is not None and "config is unknown" in unknown
    assert mla_layout_refusal("npu", ("paged",), []) is not None  # neither layout


def test_a_step_with_prefill_context_is_refused_where_latents_are_split() -> None:
    """The builder's guard: vLLM's prefill metadata with a chunked context (forward_mha will
    gather it from the joint plane) over split layers is refused; without split layers, or
    without context, the step goes on."""
    with_context = SimpleNamespace(chunked_context=object())
    with pytest.raises(AttnhubConfigurationError, match=r"layers model\.layers\.0\.attn"):
        refuse_split_prefill_context(["model.layers.0.attn"], with_context)
    refuse_split_prefill_context([], with_context)
    refuse_split_prefill_context(["model.layers.0.attn"], SimpleNamespace(chunked_context=None))
    refuse_split_prefill_context(["model.layers.0.attn"], None)  # a step without prefills


def _engine_config(**over: object) -> SimpleNamespace:
    """A VllmConfig look-alike as vLLM's CPU platform leaves it for an MLA model."""
    fields = dict(
        scheduler_config=SimpleNamespace(enable_chunked_prefill=False),
        cache_config=SimpleNamespace(enable_prefix_caching=False, kv_offloading_size=None),
        speculative_config=None,
        kv_transfer_config=None,
    )
    return SimpleNamespace(**(fields | over))


@pytest.mark.parametrize(
    ("over", "named"),
    [
        ({"scheduler_config": SimpleNamespace(enable_chunked_prefill=True)}, "chunked prefill"),
        (
            {"cache_config": SimpleNamespace(enable_prefix_caching=True, kv_offloading_size=0)},
            "prefix caching",
        ),
        ({"speculative_config": object()}, "speculative decoding"),
        ({"kv_transfer_config": object()}, "KV connector"),
        (
            {"cache_config": SimpleNamespace(enable_prefix_caching=False, kv_offloading_size=4)},
            "KV offloading",
        ),
        ({"scheduler_config": SimpleNamespace()}, "chunked prefill"),  # not said: counted on
    ],
)
def test_prefill_context_sources_name_each_setting(over: dict, named: str) -> None:
    assert prefill_context_sources(_engine_config()) == []
    found = prefill_context_sources(_engine_config(**over))
    assert len(found) == 1 and named in found[0], found


def test_page_moving_sources_are_the_ones_whoever_serves_the_prefill() -> None:
    """A KV connector and KV offloading move pages by block id: split planes in vLLM's memory
    are refused with them even where attnhub serves the prefill (the bind passes these alone
    then); chunked prefill, prefix caching and speculative decoding are not among them."""
    from attnhub_vllm.mapping import page_moving_sources

    assert page_moving_sources(_engine_config()) == []
    on = _engine_config(
        scheduler_config=SimpleNamespace(enable_chunked_prefill=True),
        cache_config=SimpleNamespace(enable_prefix_caching=True, kv_offloading_size=4),
        speculative_config=object(),
        kv_transfer_config=object(),
    )
    movers = page_moving_sources(on)
    assert [m.split(" (")[0] for m in movers] == [
        "a KV connector is configured",
        "KV offloading is on",
    ]
    assert prefill_context_sources(on)[-2:] == movers
    assert mla_layout_refusal("ascend", ("split",), movers) is not None
    assert mla_layout_refusal("ascend", ("split",), []) is None


def test_split_latent_cache_is_carved_in_place_from_vllms_plane() -> None:
    """A backend's split planes in vLLM's own MLA plane: the memory read as every block's kv_c
    then every block's k_pe, dense, no byte beside it. Written through attnhub, the bytes lie
    where that view says, every other byte untouched."""
    from attnhub.mla import MLASpec, write_latent_kv

    spec = MLASpec(**MLA_LAYER)
    g = torch.Generator().manual_seed(1)
    plane = torch.randn((3, 16, 576), generator=g)  # vLLM's MLA kv_cache of one layer
    before = plane.clone()
    cache = latent_cache(plane, spec, layout="split")
    assert cache.layout == "split" and extra_kv_bytes(cache, plane) == 0
    assert cache.kv_c.is_contiguous() and cache.k_pe.is_contiguous()
    assert cache.kv_c.shape == (3, 16, 512) and cache.k_pe.shape == (3, 16, 64)
    kv_c, k_pe = torch.randn((3, 512), generator=g), torch.randn((3, 64), generator=g)
    slots = torch.tensor([5, -1, 33])
    write_latent_kv(spec, cache, kv_c, k_pe, slots)
    want = before.view(-1).clone()
    edge = 3 * 16 * 512
    want[:edge].view(-1, 512)[[5, 33]] = kv_c[[0, 2]]
    want[edge:].view(-1, 64)[[5, 33]] = k_pe[[0, 2]]
    assert torch.equal(plane.view(-1), want)
    with pytest.raises(AttnhubConfigurationError, match="one dense"):
        latent_cache(torch.zeros(3, 32, 576)[:, :16], spec, layout="split")


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_latent_cache_views_vllms_fp8_plane_in_the_specs_format(fmt: str) -> None:
    """vLLM allocates an fp8 MLA cache as uint8 and ``MLAAttention.forward_impl`` views it as
    ``float8_e4m3fn`` whatever the format: either way attnhub's view is the spec's fp8 dtype
    over the same bytes, with the layer's ``_k_scale`` itself (a one-element tensor, ``[]`` or
    ``[1]``: the engine's in-place calibration is what the cache reads)."""
    spec, _ = mla_spec_from_vllm(**(MLA_LAYER | {"dtype": torch.bfloat16}), kv_cache_dtype=fmt)
    assert spec is not None and spec.kv_cache_dtype == fmt
    plane = torch.randint(0, 256, (3, 16, 576), dtype=torch.uint8)
    storage = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[fmt]
    for given, k_scale in (
        (plane, torch.tensor([0.5])),
        (plane.view(torch.float8_e4m3fn), torch.tensor(0.5)),
    ):
        cache = latent_cache(given, spec, k_scale)
        assert cache.kv_c.dtype == cache.k_pe.dtype == storage
        assert cache.joint.data_ptr() == plane.data_ptr()
        assert torch.equal(cache.joint.view(torch.uint8), plane)
        assert cache.scale is k_scale and float(cache.scale) == 0.5
