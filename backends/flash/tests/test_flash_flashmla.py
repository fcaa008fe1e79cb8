"""FlashMLA through vLLM's ``vllm.v1.attention.ops.flashmla`` (provider ``vllm-flashmla``): the
emulated dense decode (``get_mla_metadata``, ``flash_mla_with_kvcache``) against
``attnhub.reference``, refused where FlashMLA's interface asserts or its kernel checks, and the
backend's one latent write and one FlashMLA call per layer with the schedule made once per step
and reused by every layer."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flash_helpers
import pytest
import torch
from attnhub_flash import BACKENDS, emulator
from attnhub_flash.emulator import FlashOpError, NotEmulatedError

from attnhub import AttentionSpec, BatchMetadata, LatentKVCache, MLASpec, reference, testing
from attnhub.capabilities import Tolerance
from attnhub.errors import UnsupportedConfigurationError
from attnhub.quant import quantize_fp8, round_probabilities, simulate_query_quantization

FLASHMLA = emulator.FLASHMLA
H, R, P, NB, BS = 4, 512, 64, 6, 64
TOL = Tolerance(atol=2e-2, rtol=2e-2)
SCALE = 0.07


def mla_spec(**changes: Any) -> MLASpec:
    return flash_helpers.mla_spec(**{"block_size": BS, **changes})


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
    step = testing.random_mla_step(backend, requests)
    assert step.cache.layout == "joint"
    return spec, backend, step.batch, step.cache, step.query, step.kv_c, step.k_pe


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
        ({"kv_cache_dtype": "fp8_e5m2"}, "mla.kv_cache_dtype", "takes e4m3 only"),
        (
            {"kv_cache_dtype": "fp8_e4m3", "dtype": torch.float16},
            "mla.kv_cache_dtype",
            "bfloat16 output only",
        ),
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


# --- fp8 latent caches: flash_mla_with_kvcache_fp8 -------------------------------------------

FP8 = torch.float8_e4m3fn
FP8_TOL = Tolerance(atol=1e-3, rtol=8e-3)  # the bfloat16 output's rounding, with room


class Fp8Call:
    """One fp8 dense decode as vLLM's FLASHMLA makes it over an fp8 cache: the latents stored
    with the layer's ``_k_scale``, the absorbed query quantized with its ``_q_scale``."""

    def __init__(self, seq_lens: list[int], s_q: int = 1, q_scale: float = 0.5):
        g = testing.generator(11)
        self.s_q, self.seq_lens = s_q, seq_lens
        self.k_scale = torch.tensor([0.03], dtype=torch.float32)
        self.q_scale = torch.tensor([q_scale], dtype=torch.float32)
        latents = torch.randn(NB, BS, R + P, generator=g).clamp(-4, 4)
        self.plane = quantize_fp8(latents, self.k_scale)
        query = torch.randn(len(seq_lens) * s_q, H, R + P, generator=g).to(torch.bfloat16)
        self.query8 = quantize_fp8(query, self.q_scale)
        blocks = -(-max(seq_lens) // BS)
        perm = torch.randperm(NB, generator=g)[:blocks].to(torch.int32)
        self.table = torch.stack([perm.roll(i) for i in range(len(seq_lens))])
        self.seqlens = torch.tensor(seq_lens, dtype=torch.int32)

    def schedule(self, seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        lens = self.seqlens if seqlens is None else seqlens
        return FLASHMLA.get_mla_metadata_dense_fp8(lens, self.s_q * H, 1)

    def run(self, **changes: Any) -> Any:
        tile, splits = self.schedule()
        kwargs: dict[str, Any] = dict(
            q=self.query8.view(len(self.seq_lens), self.s_q, H, R + P),
            k_cache=self.plane.unsqueeze(-2),
            block_table=self.table,
            cache_seqlens=self.seqlens,
            head_dim_v=R,
            tile_scheduler_metadata=tile,
            num_splits=splits,
            softmax_scale=SCALE,
            causal=True,
            descale_q=self.q_scale,
            descale_k=self.k_scale,
        )
        kwargs.update(changes)
        return FLASHMLA.flash_mla_with_kvcache_fp8(**kwargs)

    def expected(self, rounding: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The absorbed form in float64 over the dequantized query and latents, the
        probabilities rounded by ``rounding`` (``attnhub.quant``) before ``P @ V``."""
        cache = LatentKVCache.from_joint(
            self.plane, R, kv_cache_dtype="fp8_e4m3", scale=self.k_scale.reshape(())
        )
        batch = BatchMetadata.from_lengths(
            [self.s_q] * len(self.seq_lens), self.seq_lens, self.table, BS
        )
        query = self.query8.double() * float(self.q_scale)
        probabilities = (
            None if rounding is None else functools.partial(round_probabilities, scheme=rounding)
        )
        outs, lses = [], []
        for r in range(batch.num_reqs):
            kv_c, k_pe = reference.read_latent_sequence(
                cache, batch.block_table[r], self.seq_lens[r]
            )
            out, lse = reference.attention(
                query[r * self.s_q : (r + 1) * self.s_q],
                torch.cat([kv_c, k_pe], dim=-1)[:, None, :],
                kv_c[:, None, :],
                scale=SCALE,
                causal=True,
                probabilities=probabilities,
            )
            outs.append(out)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("s_q", [1, 2], ids=["decodes", "uniform-multi-token"])
def test_fp8_decode_descales_and_rounds_the_probabilities_unscaled(s_q: int) -> None:
    """Scores over the e4m3 query and latents times ``softmax_scale * descale_q * descale_k``;
    ``exp(s - max)`` rounded to e4m3 unscaled (``fp8_e4m3_unscaled``) before ``P @ V`` over the
    stored values, times ``descale_k`` over the unrounded sum; bfloat16 out, float32 LSE."""
    call = Fp8Call([70, 3, 130], s_q=s_q)  # descale_q 0.5, descale_k 0.03: both read
    out, lse = call.run()
    B = len(call.seq_lens)
    assert out.shape == (B, s_q, H, R) and out.dtype == torch.bfloat16
    assert lse.shape == (B, H, s_q) and lse.dtype == torch.float32
    got = out.reshape(-1, H, R)
    rounded, want_lse = call.expected("fp8_e4m3_unscaled")
    assert testing.mismatch(got, rounded, FP8_TOL) is None
    # the rounding is what the output shows: without it, or with the 2**8-scaled scheme
    # (FA3's), the output is not within the bfloat16 rounding
    assert testing.mismatch(got, call.expected(None)[0], FP8_TOL) is not None
    assert testing.mismatch(got, call.expected("fp8_e4m3")[0], FP8_TOL) is not None
    got_lse = lse.permute(1, 0, 2).reshape(H, -1)
    assert torch.allclose(got_lse.double(), want_lse, atol=1e-4)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("q_bf16", "kFloat8_e4m3fn"),
        ("cache_e5m2", "query and key must have the same dtype"),
        ("no_descale_q", "descale is required when input dtype is fp8"),
        ("no_descale_k", "descale is required when input dtype is fp8"),
        ("descale_shape", r"descale_k_ must have shape \(1\)"),
        ("descale_f64", "kFloat"),
        ("page16", "page_block_size must be 64"),
        ("head512", "Only head_size_k == 576"),
        ("head_dim_v", "Only head_size_v == 512"),
        ("seqlens_int64", "seqlens_k must have dtype int32"),
        ("splits_int64", "num_splits must have dtype int32"),
        ("splits_shape", r"num_splits must have shape \(batch_size\+1\)"),
        ("tile_width", "TileSchedulerMetaDataSize"),
        ("stale_schedule", "planned .* for other cache_seqlens"),
        ("heads", "must divide number of heads in query"),
        ("outside", "outside the cache"),
    ],
)
def test_what_the_fp8_decode_refuses_is_refused(change: str, match: str) -> None:
    call = Fp8Call([70, 3])
    kwargs: dict[str, Any] = {}
    q8 = call.query8.view(2, 1, H, R + P)
    tile, splits = call.schedule()
    if change == "q_bf16":
        kwargs["q"] = q8.to(torch.bfloat16)
    elif change == "cache_e5m2":
        kwargs["k_cache"] = call.plane.to(torch.float8_e5m2).unsqueeze(-2)
    elif change == "no_descale_q":
        kwargs["descale_q"] = None
    elif change == "no_descale_k":
        kwargs["descale_k"] = None
    elif change == "descale_shape":
        kwargs["descale_k"] = call.k_scale.expand(2).contiguous()
    elif change == "descale_f64":
        kwargs["descale_q"] = call.q_scale.double()
    elif change == "page16":
        kwargs["k_cache"] = call.plane.reshape(NB * 4, 16, 1, R + P)
    elif change == "head512":
        kwargs["q"] = q8[..., :R].contiguous()
        kwargs["k_cache"] = call.plane[..., :R].unsqueeze(-2)
    elif change == "head_dim_v":
        kwargs["head_dim_v"] = 576
    elif change == "seqlens_int64":
        kwargs["cache_seqlens"] = call.seqlens.long()
    elif change == "splits_int64":
        kwargs["num_splits"] = splits.long()
    elif change == "splits_shape":
        kwargs["num_splits"] = splits[:2].contiguous()
    elif change == "tile_width":
        kwargs["tile_scheduler_metadata"] = tile[:, :7].contiguous()
    elif change == "stale_schedule":
        kwargs["tile_scheduler_metadata"], kwargs["num_splits"] = call.schedule(
            torch.tensor([71, 3], dtype=torch.int32)
        )
    elif change == "heads":
        kwargs["k_cache"] = call.plane.view(NB, BS, 1, R + P).expand(NB, BS, 3, R + P)
    elif change == "outside":
        table = call.table.clone()
        table[0, 0] = NB
        kwargs["block_table"] = table
    with pytest.raises(FlashOpError, match=match):
        call.run(**kwargs)


def test_the_fp8_schedule_is_sized_as_the_extension_plans_it() -> None:
    """``num_sm_parts = sm_count / num_heads_k / ceil_div(num_heads_per_head_k, 64)`` (132 SMs:
    an H100 / H200), ``num_splits`` batch + 1, both int32."""
    lens = torch.tensor([70, 3, 9], dtype=torch.int32)
    tile, splits = FLASHMLA.get_mla_metadata_dense_fp8(lens, 128, 1)
    assert tile.shape == (66, 8) and tile.dtype == torch.int32
    assert splits.shape == (4,) and splits.dtype == torch.int32
    with pytest.raises(FlashOpError, match="kInt32"):
        FLASHMLA.get_mla_metadata_dense_fp8(lens.long(), 128, 1)


def test_an_fp8_layer_writes_vllms_bytes_and_makes_one_fp8_call() -> None:
    spec, backend, batch, cache, query, kv_c, k_pe = _step(
        [(1, 70), (1, 3), (1, 130)], kv_cache_dtype="fp8_e4m3"
    )
    assert cache.scale is not None and cache.joint.dtype == FP8
    want_cache = cache.clone()
    reference.write_latent_kv(want_cache, kv_c, k_pe, batch.slot_mapping)
    with emulator.record_calls() as planned:
        meta = backend.metadata_builder().build(batch)
    assert [c.name.rsplit(".", 1)[1] for c in planned] == [
        "get_mla_metadata",
        "get_mla_metadata_dense_fp8",
    ]
    with emulator.record_calls() as calls:
        out = backend.impl().forward(query, kv_c, k_pe, cache, meta)
    assert [c.name for c in calls] == [
        "vllm._custom_ops.concat_and_cache_mla",
        "vllm.v1.attention.ops.flashmla.flash_mla_with_kvcache_fp8",
    ]
    write, attend = calls[0], calls[1]
    assert write.args[4] == "fp8_e4m3" and write.args[5] is cache.scale
    kwargs = attend.kwargs
    assert kwargs["q"].dtype == FP8 and kwargs["q"].shape == (3, 1, H, R + P)
    assert float(kwargs["descale_q"]) == 1.0 and torch.equal(
        kwargs["descale_k"], cache.scale.reshape(1)
    )
    assert (kwargs["head_dim_v"], kwargs["causal"], kwargs["softmax_scale"]) == (
        R,
        True,
        spec.scale,
    )
    assert cache.equal(want_cache)  # concat_and_cache_mla's bytes: fp8(x / scale), saturated
    n = batch.num_actual_tokens
    kernel_query = simulate_query_quantization(query[:n], "fp8_static")
    want, _ = reference.paged_mla_absorbed(kernel_query, cache, batch, spec)
    allowance = testing.mla_probability_allowance(
        kernel_query, cache, batch, spec, "fp8_e4m3_unscaled"
    )
    assert out.dtype == torch.bfloat16
    assert testing.mismatch(out[:n], want, TOL, allowance=allowance) is None
    assert bool((out[n:] == 0).all())


def test_concat_and_cache_mla_writes_the_same_fp8_bytes_into_a_uint8_cache() -> None:
    """vLLM allocates fp8 caches as uint8 and its write reinterprets the bytes."""
    g = testing.generator(3)
    kv_c = torch.randn(5, R, generator=g).to(torch.bfloat16)
    k_pe = torch.randn(5, P, generator=g).to(torch.bfloat16)
    slots = torch.tensor([3, -1, 70, 0, 127], dtype=torch.int64)
    scale = torch.tensor([0.125], dtype=torch.float32)
    as_fp8 = torch.zeros(2, BS, R + P, dtype=FP8)
    as_bytes = torch.zeros(2, BS, R + P, dtype=torch.uint8)
    for cache in (as_fp8, as_bytes):
        emulator.VLLM_CACHE_OPS.concat_and_cache_mla(kv_c, k_pe, cache, slots, "fp8", scale)
    assert torch.equal(as_fp8.view(torch.uint8), as_bytes)
    entries = torch.cat([kv_c, k_pe], dim=-1)
    assert torch.equal(as_fp8.view(-1, R + P)[70], quantize_fp8(entries[2], scale))
    with pytest.raises(FlashOpError, match="must hold bytes"):
        emulator.VLLM_CACHE_OPS.concat_and_cache_mla(
            kv_c, k_pe, torch.zeros(2, BS, R + P, dtype=torch.bfloat16), slots, "fp8", scale
        )
    with pytest.raises(NotEmulatedError, match="fp8_e5m2"):
        emulator.VLLM_CACHE_OPS.concat_and_cache_mla(kv_c, k_pe, as_bytes, slots, "fp8_e5m2", scale)


def test_an_fp8_latent_scale_of_shape_one_makes_the_same_bytes_and_output() -> None:
    """A latent cache's fp8 scale may be ``()`` or ``(1,)``, as a paged KV cache's per-tensor
    scale: vLLM's write op and the fp8 decode (``descale_k``, ``(1,)``) read the same value."""
    got = []
    for shape in [(), (1,)]:
        _, backend, batch, cache, query, kv_c, k_pe = _step(
            [(1, 70), (1, 3)], kv_cache_dtype="fp8_e4m3"
        )
        cache = dataclasses.replace(cache, scale=torch.full(shape, 0.03))
        meta = backend.metadata_builder().build(batch)
        got.append((backend.impl().forward(query, kv_c, k_pe, cache, meta), cache.joint))
    (out0, joint0), (out1, joint1) = got
    assert torch.equal(out0, out1)
    assert torch.equal(joint0.view(torch.uint8), joint1.view(torch.uint8))
