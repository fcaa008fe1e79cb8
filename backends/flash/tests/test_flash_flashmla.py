"""FlashMLA through vLLM's ``vllm.v1.attention.ops.flashmla`` (provider ``vllm-flashmla``): the
emulated dense decode (``get_mla_metadata``, ``flash_mla_with_kvcache``) against
``attnhub.reference``, refused where FlashMLA's interface asserts or its kernel checks, and the
backend's one latent write and one FlashMLA call per layer with the schedule made once per step
and reused by every layer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from attnhub_flash import BACKENDS, emulator
from attnhub_flash.emulator import FlashOpError, NotEmulatedError

from attnhub import AttentionSpec, BatchMetadata, LatentKVCache, MLASpec, reference, testing
from attnhub.capabilities import Tolerance
from attnhub.errors import UnsupportedConfigurationError

FLASHMLA = emulator.FLASHMLA
H, R, P, NB, BS = 4, 512, 64, 6, 64
TOL = Tolerance(atol=2e-2, rtol=2e-2)
SCALE = 0.07


def mla_spec(**changes: Any) -> MLASpec:
    fields: dict[str, Any] = dict(
        num_heads=H,
        kv_lora_rank=R,
        qk_rope_head_dim=P,
        qk_nope_head_dim=128,
        v_head_dim=128,
        dtype=torch.bfloat16,
        block_size=BS,
    )
    fields.update(changes)
    return MLASpec(**fields)


class Call:
    """One dense decode over a random joint latent plane, as vLLM's FLASHMLA makes it."""

    def __init__(self, seq_lens: list[int], s_q: int = 1, dtype: torch.dtype = torch.bfloat16):
        g = testing.generator(5)
        self.s_q, self.seq_lens = s_q, seq_lens
        self.plane = torch.randn(NB, BS, R + P, generator=g).to(dtype)
        self.query = torch.randn(len(seq_lens) * s_q, H, R + P, generator=g).to(dtype)
        blocks = -(-max(seq_lens) // BS)
        perm = torch.randperm(NB, generator=g)[:blocks].to(torch.int32)
        self.table = torch.stack([perm.roll(i) for i in range(len(seq_lens))])
        self.seqlens = torch.tensor(seq_lens, dtype=torch.int32)

    def run(self, sched: Any = None, **changes: Any) -> Any:
        if sched is None:
            sched = FLASHMLA.get_mla_metadata(self.seqlens, self.s_q * H, 1)[0]
        kwargs: dict[str, Any] = dict(
            q=self.query.view(len(self.seq_lens), self.s_q, H, R + P),
            k_cache=self.plane.unsqueeze(-2),
            block_table=self.table,
            cache_seqlens=self.seqlens,
            head_dim_v=R,
            tile_scheduler_metadata=sched,
            softmax_scale=SCALE,
            causal=True,
        )
        kwargs.update(changes)
        return FLASHMLA.flash_mla_with_kvcache(**kwargs)

    def expected(self) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H, R], [H, T]
        spec = mla_spec(scale=SCALE)
        cache = LatentKVCache.from_joint(self.plane, R)
        batch = BatchMetadata.from_lengths(
            [self.s_q] * len(self.seq_lens), self.seq_lens, self.table, BS
        )
        return reference.paged_mla_absorbed(self.query, cache, batch, spec)


# --- the emulated ops --------------------------------------------------------------------------


@pytest.mark.parametrize("s_q", [1, 3], ids=["decodes", "uniform-multi-token"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_decode_is_mqa_over_the_latent_with_values_its_first_512(
    s_q: int, dtype: torch.dtype
) -> None:
    """Keys ``[kv_c ; k_pe]`` (576), values ``kv_c`` (512), causal bottom-right."""
    call = Call([70, 3, 130], s_q=s_q, dtype=dtype)
    out, lse = call.run()
    want, want_lse = call.expected()
    B = len(call.seq_lens)
    assert out.shape == (B, s_q, H, R) and out.dtype == dtype
    assert lse.shape == (B, H, s_q) and lse.dtype == torch.float32
    assert testing.mismatch(out.reshape(-1, H, R), want, TOL) is None
    got_lse = lse.permute(1, 0, 2).reshape(H, -1)  # [H, T], token b * s_q + i
    assert torch.allclose(got_lse, want_lse.float(), atol=1e-3)


def test_causal_is_bottom_right_and_dropped_for_one_query() -> None:
    """Without causal every query of a request sees all its keys; with one query per request
    the kernel drops causal ('if (seqlen_q_ori == 1) { is_causal = false; }')."""
    call = Call([40, 9], s_q=2)
    assert testing.mismatch(call.run()[0], call.run(causal=False)[0], TOL) is not None
    one = Call([40, 9])
    assert torch.equal(one.run()[0], one.run(causal=False)[0])


def test_the_first_call_fills_the_schedule_and_later_calls_reuse_it() -> None:
    call = Call([70, 3])
    sched, none = FLASHMLA.get_mla_metadata(call.seqlens, H, 1, is_fp8_kvcache=False)
    assert none is None and not sched.have_initialized and sched.tile_scheduler_metadata is None
    first = call.run(sched)[0]
    planned = sched.tile_scheduler_metadata
    assert sched.have_initialized and sched.config.b == 2 and sched.config.page_block_size == BS
    assert planned is not None and planned.dtype == torch.int32 and planned.shape[1] == 8
    assert sched.num_splits is not None and sched.num_splits.shape == (3,)
    assert torch.equal(call.run(sched)[0], first)
    assert sched.tile_scheduler_metadata is planned  # reused, not planned again


def test_a_reused_schedule_must_match_the_call() -> None:
    call = Call([70, 3])
    sched = FLASHMLA.get_mla_metadata()[0]
    call.run(sched)
    with pytest.raises(AssertionError, match=r"sched_meta.config.causal must be equal"):
        call.run(sched, causal=False)
    other = Call([70, 3], s_q=2)
    with pytest.raises(AssertionError, match=r"sched_meta.config.s_q must be equal"):
        other.run(sched)
    with pytest.raises(FlashOpError, match="made for other cache_seqlens"):
        call.run(sched, cache_seqlens=torch.tensor([71, 3], dtype=torch.int32))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ("page16", FlashOpError, "page_block_size must be 64"),
        ("head512", FlashOpError, r"params.d == Config::HEAD_DIM_K"),
        ("head_dim_v", FlashOpError, "Only head_size_v"),
        ("fp32", FlashOpError, "kBFloat16"),
        ("cache_dtype", FlashOpError, "query and key must have the same dtype"),
        ("seqlens_int64", FlashOpError, "seqlens_k must have dtype int32"),
        ("table_int64", FlashOpError, "block_table must have dtype torch.int32"),
        ("num_splits", AssertionError, "num_splits must be None"),
        ("sched_tensor", AssertionError, "must be of type FlashMLASchedMeta"),
        ("no_table", AssertionError, "block_table and cache_seqlens must be provided"),
        ("heads", FlashOpError, "must divide number of heads in query"),
        ("short_table", FlashOpError, "the table row has"),
        ("outside", FlashOpError, "outside the cache"),
    ],
)
def test_what_flashmla_refuses_is_refused(change: str, error: type, match: str) -> None:
    call = Call([70, 3])
    kwargs: dict[str, Any] = {}
    q = call.query.view(2, 1, H, R + P)
    if change == "page16":
        kwargs["k_cache"] = call.plane.reshape(NB * 4, 16, 1, R + P)
    elif change == "head512":
        kwargs["q"] = q[..., :R].contiguous()
        kwargs["k_cache"] = call.plane[..., :R].unsqueeze(-2)
    elif change == "head_dim_v":
        kwargs["head_dim_v"] = 256
    elif change == "fp32":
        kwargs["q"], kwargs["k_cache"] = q.float(), call.plane.float().unsqueeze(-2)
    elif change == "cache_dtype":
        kwargs["k_cache"] = call.plane.half().unsqueeze(-2)
    elif change == "seqlens_int64":
        kwargs["cache_seqlens"] = call.seqlens.long()
    elif change == "table_int64":
        kwargs["block_table"] = call.table.long()
    elif change == "num_splits":
        kwargs["num_splits"] = torch.zeros(3, dtype=torch.int32)
    elif change == "sched_tensor":
        kwargs["tile_scheduler_metadata"] = torch.zeros(1, 8, dtype=torch.int32)
    elif change == "no_table":
        kwargs["block_table"] = None
    elif change == "heads":
        kwargs["k_cache"] = call.plane.view(NB, BS, 1, R + P).expand(NB, BS, 3, R + P)
    elif change == "short_table":
        kwargs["block_table"] = call.table[:, :1].contiguous()
    elif change == "outside":
        table = call.table.clone()
        table[0, 0] = NB
        kwargs["block_table"] = table
    with pytest.raises(error, match=match):
        call.run(**kwargs)


def test_the_sparse_path_and_out_are_valid_but_not_emulated() -> None:
    call = Call([70, 3])
    with pytest.raises(NotEmulatedError, match="indices"):
        call.run(indices=torch.zeros(2, 1, 64, dtype=torch.int32), causal=False)
    with pytest.raises(NotEmulatedError, match="out"):
        call.run(out=torch.empty(2, 1, H, R, dtype=torch.bfloat16))


# --- the backend (provider vllm-flashmla) ------------------------------------------------------


def _step(requests: list[tuple[int, int]], **changes: Any) -> tuple[Any, ...]:
    spec = mla_spec(**changes)
    backend = BACKENDS["vllm-flashmla"](spec, "cpu", emulate=True)
    g = testing.generator(9)
    batch, nb = testing.make_batch(
        [q for q, _ in requests],
        [s for _, s in requests],
        spec.block_size,
        seed=g,
        num_tokens=sum(q for q, _ in requests) + 2,
    )
    cache = backend.allocate_kv_cache(nb + 1)
    assert isinstance(cache, LatentKVCache) and cache.layout == "joint"
    testing.fill_latent_cache_random(cache, g)
    kv_c, k_pe = testing.random_latent_kv(spec, batch.num_tokens, g)
    query = testing.random_mla_query(spec, batch.num_tokens, g)
    return spec, backend, batch, cache, query, kv_c, k_pe


def test_a_layer_makes_one_latent_write_and_one_flashmla_call() -> None:
    spec, backend, batch, cache, query, kv_c, k_pe = _step([(1, 70), (1, 3), (1, 130)])
    want_cache = cache.clone()
    reference.write_latent_kv(want_cache, kv_c, k_pe, batch.slot_mapping)
    with emulator.record_calls() as planned:
        meta = backend.metadata_builder().build(batch)
    assert [c.name for c in planned] == ["vllm.v1.attention.ops.flashmla.get_mla_metadata"]
    with emulator.record_calls() as calls:
        out, lse = backend.impl().forward(query, kv_c, k_pe, cache, meta, return_lse=True)
    assert [c.name for c in calls] == [
        "vllm._custom_ops.concat_and_cache_mla",
        "vllm.v1.attention.ops.flashmla.flash_mla_with_kvcache",
    ]
    kwargs = calls[-1].kwargs
    assert kwargs["q"].shape == (3, 1, H, R + P) and kwargs["k_cache"].shape[1:] == (BS, 1, R + P)
    assert (kwargs["head_dim_v"], kwargs["causal"], kwargs["softmax_scale"]) == (
        R,
        True,
        spec.scale,
    )
    assert cache.equal(want_cache)
    want, want_lse = reference.paged_mla_absorbed(query, cache, batch, spec)
    n = batch.num_actual_tokens
    assert testing.mismatch(out[:n], want, TOL) is None
    assert torch.allclose(lse[:n], want_lse.float().t(), atol=1e-3)
    assert bool((out[n:] == 0).all())


def test_every_layer_of_a_step_reuses_the_schedule_its_first_call_made() -> None:
    _, backend, batch, cache, query, kv_c, k_pe = _step([(1, 70), (1, 3)])
    meta = backend.metadata_builder().build(batch)
    sched = meta.kwargs["tile_scheduler_metadata"]
    layers = [backend.impl(), backend.impl()]
    layers[0].forward(query, kv_c, k_pe, cache, meta)
    planned = sched.tile_scheduler_metadata
    assert planned is not None
    layers[1].forward(query, kv_c, k_pe, cache, meta)
    assert sched.tile_scheduler_metadata is planned
    assert backend.metadata_builder().build(batch).kwargs["tile_scheduler_metadata"] is not sched


def test_a_prefill_is_refused_by_the_builder() -> None:
    _, backend, batch, *_ = _step([(1, 70), (4, 9)])
    with pytest.raises(UnsupportedConfigurationError, match="decode only"):
        backend.metadata_builder().build(batch)


@pytest.mark.parametrize(
    ("changes", "field", "match"),
    [
        ({"block_size": 16}, "mla.block_size", "pages by 64"),
        ({"kv_lora_rank": 256}, "mla.latent_size", "head_dim 576"),
        ({"kv_cache_dtype": "fp8_e4m3"}, "mla.kv_cache_dtype", "fp8 dense decode"),
        ({"dtype": torch.float32}, "mla.dtype", "float16 and bfloat16"),
    ],
)
def test_what_flashmla_does_not_take_is_refused_with_its_reason(
    changes: dict[str, Any], field: str, match: str
) -> None:
    reasons = BACKENDS["vllm-flashmla"].unsupported_reasons(mla_spec(**changes))
    assert [r.field for r in reasons] == [field]
    with pytest.raises(UnsupportedConfigurationError, match=match):
        BACKENDS["vllm-flashmla"](mla_spec(**changes), "cpu", emulate=True)


@pytest.mark.parametrize(
    "changes",
    [
        dict(head_size=192, head_size_v=128, use_sinks=True),  # no s_aux with hdim != hdim_v
        dict(head_size=64, head_size_v=512, kv_cache_dtype="fp8_e4m3"),
        dict(use_alibi=True),
        dict(block_size=8),
        dict(kv_cache_dtype="fp8_e4m3", dtype=torch.float16),
        dict(head_size=128),
    ],
)
def test_standard_layers_are_refused_and_served_as_on_vllm_fa3(changes: dict[str, Any]) -> None:
    fields: dict[str, Any] = dict(
        num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, block_size=16
    )
    fields.update(changes)
    spec = AttentionSpec(**fields)
    want = [str(r) for r in BACKENDS["vllm-fa3"].unsupported_reasons(spec)]
    got = [str(r) for r in BACKENDS["vllm-flashmla"].unsupported_reasons(spec)]
    assert got == [w.replace("vllm-fa3", "vllm-flashmla") for w in want]


def test_standard_attention_is_vllm_fa3s() -> None:
    fa3, flashmla = BACKENDS["vllm-fa3"].capabilities, BACKENDS["vllm-flashmla"].capabilities
    assert flashmla.mla.block_sizes == frozenset({64}) and flashmla.mla.max_query_len == 1
    assert {f: getattr(fa3, f) for f in ("dtypes", "block_size_multiple", "sinks")} == {
        f: getattr(flashmla, f) for f in ("dtypes", "block_size_multiple", "sinks")
    }


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ((True, None), None),
        (
            (False, "FlashMLA Dense is only supported on Hopper devices."),
            "only supported on Hopper",
        ),
    ],
)
def test_a_native_provider_asks_vllm_whether_flashmla_dense_runs(
    answer: tuple[bool, str | None], expected: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On ``cuda`` the provider needs vLLM's FA3 (as vllm-fa3) and vLLM's own
    ``is_flashmla_dense_supported()`` (the module's probe of ``vllm._flashmla_C`` and Hopper)."""
    from types import SimpleNamespace

    from attnhub_flash import ops, providers

    fork = SimpleNamespace(fa_version_unsupported_reason=lambda fa_version: None)
    flashmla = SimpleNamespace(is_flashmla_dense_supported=lambda: answer)
    modules = {"vllm.vllm_flash_attn": fork, "vllm.v1.attention.ops.flashmla": flashmla}
    monkeypatch.setattr(ops, "import_once", lambda name: (modules[name], None))
    why = providers.VLLM_FLASHMLA.native_reason(torch.device("cuda"))
    if expected is None:
        assert why is None
    else:
        assert why is not None and expected in why and "vllm-flashmla" in why
