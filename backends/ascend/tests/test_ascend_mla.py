"""The ascend backend's MLA layers: FIA's MLA form in the emulator (what the FIA doc allows with
query_rope / key_rope, refused where the doc refuses it) and the backend's one write and one
FIA call per layer, each checked against ``attnhub.reference``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from attnhub_ascend import AscendBackend, emulator
from attnhub_ascend.backend import RESHAPE_AND_CACHE
from attnhub_ascend.emulator import NotEmulatedError, NpuOpError

from attnhub import BatchMetadata, LatentKVCache, MLASpec, reference, testing
from attnhub.capabilities import Tolerance
from attnhub.errors import UnsupportedConfigurationError
from attnhub.graphs import GraphRunner

FIA = emulator.npu_fused_infer_attention_score
N, R, P, NB = 32, 512, 64, 6
TOL = Tolerance(atol=2e-2, rtol=2e-2)


def mla_spec(**changes: Any) -> MLASpec:
    fields: dict[str, Any] = dict(
        num_heads=N,
        kv_lora_rank=R,
        qk_rope_head_dim=P,
        qk_nope_head_dim=128,
        v_head_dim=128,
        dtype=torch.bfloat16,
        block_size=16,
    )
    fields.update(changes)
    return MLASpec(**fields)


class Call:
    """One FIA MLA-form call over random planes: the keyword arguments a test may change."""

    def __init__(self, query_lens: list[int], seq_lens: list[int], bs: int = 16) -> None:
        g = testing.generator(5)
        self.bs = bs
        self.k_nope = torch.randn(NB, 1, bs, R, generator=g).bfloat16()
        self.k_pe = torch.randn(NB, 1, bs, P, generator=g).bfloat16()
        T = sum(query_lens)
        self.q_nope = torch.randn(T, N, R, generator=g).bfloat16()
        self.q_pe = torch.randn(T, N, P, generator=g).bfloat16()
        blocks = -(-max(seq_lens) // bs)
        perm = torch.randperm(NB, generator=g)[:blocks].to(torch.int32)
        self.table = torch.stack([perm.roll(i) for i in range(len(seq_lens))])
        self.query_lens, self.seq_lens = query_lens, seq_lens
        longer = max(query_lens) > 1
        self.kwargs: dict[str, Any] = dict(
            query_rope=self.q_pe,
            key_rope=self.k_pe,
            num_heads=N,
            num_key_value_heads=1,
            input_layout="TND",
            atten_mask=emulator.compressed_causal_mask() if longer else None,
            sparse_mode=3 if longer else 0,
            scale=0.07,
            block_table=self.table,
            block_size=bs,
            actual_seq_lengths=torch.tensor(query_lens).cumsum(0).tolist(),
            actual_seq_lengths_kv=seq_lens,
        )

    def run(self, **changes: Any) -> tuple[torch.Tensor, torch.Tensor]:
        kwargs = {**self.kwargs, **changes}
        value = kwargs.pop("value", self.k_nope)
        return FIA(kwargs.pop("query", self.q_nope), self.k_nope, value, **kwargs)  # type: ignore[no-any-return]

    def expected(self) -> torch.Tensor:
        spec = mla_spec(block_size=self.bs, scale=0.07)
        cache = LatentKVCache(
            kv_c=self.k_nope.view(NB, self.bs, R),
            k_pe=self.k_pe.view(NB, self.bs, P),
            block_size=self.bs,
            layout="split",
        )
        batch = BatchMetadata.from_lengths(self.query_lens, self.seq_lens, self.table, self.bs)
        query = torch.cat([self.q_nope, self.q_pe], dim=-1)
        return reference.paged_mla_absorbed(query, cache, batch, spec)[0]


# --- the emulator's MLA form ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "bs"),
    [([1, 1, 1], [17, 3, 40], 16), ([2, 1, 16], [20, 9, 33], 16), ([1, 3], [130, 200], 128)],
    ids=["decodes-sparse0", "multi-token-sparse3", "block128"],
)
def test_the_mla_form_computes_q_nope_k_nope_plus_q_rope_k_rope_over_the_nope_values(
    query_lens: list[int], seq_lens: list[int], bs: int
) -> None:
    call = Call(query_lens, seq_lens, bs)
    out, lse = call.run()
    assert out.shape == call.q_nope.shape and out.dtype == torch.bfloat16
    assert testing.mismatch(out, call.expected(), TOL) is None
    assert lse.shape == (1,)  # no LSE flag: the reserved [1] zero


def test_the_mla_form_reads_the_rope_part() -> None:
    call = Call([1, 2], [9, 30])
    out, _ = call.run()
    zero_rope, _ = call.run(query_rope=torch.zeros_like(call.q_pe))
    assert not torch.allclose(out.float(), zero_rope.float(), atol=1e-2)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"softmax_lse_flag": True}, "returns no LSE"),
        ({"key_rope": None}, "together"),
        ({"num_key_value_heads": 0}, "key N 1"),
        ({"block_size": 32}, "16 or 128"),
        ({"sparse_mode": 3}, "sparse_mode=0 without atten_mask"),
        ({"atten_mask": "mask"}, "sparse_mode=0 without atten_mask"),
        ({"query_rope": "wrong_width"}, "query_rope must be"),
        ({"query_rope": "fp16"}, "query_rope must be"),
        ({"block_table": None}, "page attention"),
        ({"actual_seq_lengths_kv": [9, 99]}, "per-sequence length"),
    ],
    ids=lambda v: v if isinstance(v, str) else next(iter(v)),
)
def test_the_mla_form_refuses_what_the_doc_refuses(changes: dict[str, Any], match: str) -> None:
    call = Call([1, 1], [9, 30])
    if changes.get("atten_mask") == "mask":
        changes = {"atten_mask": emulator.compressed_causal_mask()}
    if changes.get("query_rope") == "wrong_width":
        changes = {"query_rope": torch.zeros(2, N, 32, dtype=torch.bfloat16)}
    if changes.get("query_rope") == "fp16":
        changes = {"query_rope": call.q_pe.half()}
    with pytest.raises(NpuOpError, match=match):
        call.run(**changes)


def test_the_mla_form_with_longer_queries_needs_sparse_mode_3_with_the_mask() -> None:
    call = Call([2, 1], [9, 30])
    with pytest.raises(NpuOpError, match="sparse_mode=3"):
        call.run(sparse_mode=0, atten_mask=None)


def test_the_mla_form_takes_at_most_16_query_tokens_per_request() -> None:
    call = Call([17, 1], [20, 30], bs=16)
    with pytest.raises(NpuOpError, match="1-16"):
        call.run()


def test_the_mla_form_takes_32_64_or_128_query_heads() -> None:
    call = Call([1], [9])
    q = call.q_nope[:, :8].contiguous()
    with pytest.raises(NpuOpError, match="32, 64 or 128"):
        call.run(query=q, query_rope=call.q_pe[:, :8].contiguous(), num_heads=8)


def test_a_value_other_than_the_nope_plane_is_not_emulated() -> None:
    call = Call([1], [9])
    with pytest.raises(NotEmulatedError, match="value other than key"):
        call.run(value=call.k_nope.clone())


# --- FIA's forms for MLA's expanded prefill (values narrower than keys) --------------------------


class Expanded:
    """Packed TND K/V for the expanded form: per-head keys 192 wide (128 + a 64 rope part),
    values 128, as many K/V heads as query heads, bfloat16."""

    def __init__(self, query_lens: list[int], kv_lens: list[int], heads: int = 4) -> None:
        g = testing.generator(8)
        T, Tk = sum(query_lens), sum(kv_lens)
        self.q = torch.randn(T, heads, 192, generator=g).bfloat16()
        self.k = torch.randn(Tk, heads, 192, generator=g).bfloat16()
        self.v = torch.randn(Tk, heads, 128, generator=g).bfloat16()
        self.query_lens, self.kv_lens, self.heads = query_lens, kv_lens, heads
        self.kwargs: dict[str, Any] = dict(
            num_heads=heads,
            num_key_value_heads=heads,
            input_layout="TND",
            atten_mask=emulator.compressed_causal_mask(),
            sparse_mode=3,
            scale=0.07,
            block_table=None,
            block_size=0,
            actual_seq_lengths=torch.tensor(query_lens).cumsum(0).tolist(),
            actual_seq_lengths_kv=torch.tensor(kv_lens).cumsum(0).tolist(),
        )

    def expected(self) -> torch.Tensor:
        """Bottom-right causal attention per request, in float64 (attnhub.reference)."""
        outs, qs, ks = [], 0, 0
        for ql, kl in zip(self.query_lens, self.kv_lens, strict=True):
            q, k = self.q[qs : qs + ql].double(), self.k[ks : ks + kl].double()
            s_ = torch.einsum("qhd,khd->hqk", q, k) * 0.07
            i, j = torch.arange(ql)[:, None], torch.arange(kl)[None, :]
            s_ = s_.masked_fill(j > i + kl - ql, float("-inf"))
            outs.append(torch.einsum("hqk,khd->qhd", s_.softmax(-1), self.v[ks : ks + kl].double()))
            qs, ks = qs + ql, ks + kl
        return torch.cat(outs)


def test_fia_takes_keys_192_with_values_128_in_tnd_without_page_attention() -> None:
    e = Expanded([3, 5], [7, 5])
    out, _ = FIA(e.q, e.k, e.v, **e.kwargs)
    assert tuple(out.shape) == (8, 4, 128)
    assert testing.mismatch(out, e.expected(), TOL) is None


def test_fias_rope_form_with_query_d_128_is_the_same_attention() -> None:
    """query D 128 + query_rope 64 over keys 128 + key_rope 64, values 128: the split of the
    same 192-wide dot product (vllm-ascend's MLA prefill without head padding)."""
    e = Expanded([3, 5], [7, 5])
    out, lse = FIA(
        e.q[..., :128].contiguous(),
        e.k[..., :128].contiguous(),
        e.v,
        query_rope=e.q[..., 128:].contiguous(),
        key_rope=e.k[..., 128:].contiguous(),
        softmax_lse_flag=True,
        **e.kwargs,
    )
    assert testing.mismatch(out, e.expected(), TOL) is None
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (8, 4, 1)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("float16", "bfloat16"),
        ("gqa", "K/V heads"),
        ("paged", "without page attention"),
        ("value_96", "value D 128 or 192"),
        ("window", "sparse_mode 0 without a mask or 3"),
    ],
)
def test_fias_differing_head_sizes_outside_the_documented_form_are_refused(
    change: str, match: str
) -> None:
    e = Expanded([3, 5], [7, 5])
    q, k, v, kw = e.q, e.k, e.v, dict(e.kwargs)
    if change == "float16":
        q, k, v = q.half(), k.half(), v.half()
    elif change == "gqa":
        k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
        kw["num_key_value_heads"] = 2
    elif change == "paged":
        kw.update(block_table=torch.zeros(2, 1, dtype=torch.int32), block_size=128)
        kw["actual_seq_lengths_kv"] = e.kv_lens
    elif change == "value_96":
        v = v[..., :96].contiguous()
    else:
        kw.update(sparse_mode=4, pre_tokens=2, next_tokens=0)
    with pytest.raises(NpuOpError, match=match):
        FIA(q, k, v, **kw)


def test_the_rope_form_with_query_d_128_refuses_page_attention_and_float16() -> None:
    call = Call([1], [9])
    with pytest.raises(NpuOpError, match="page attention"):
        call.run(
            query=torch.zeros(1, N, 128, dtype=torch.bfloat16),
            query_rope=torch.zeros(1, N, 64, dtype=torch.bfloat16),
        )
    e = Expanded([2], [2])
    with pytest.raises(NpuOpError, match="bfloat16"):
        FIA(
            e.q[..., :128].half().contiguous(),
            e.k[..., :128].half().contiguous(),
            e.v.half(),
            query_rope=e.q[..., 128:].half().contiguous(),
            key_rope=e.k[..., 128:].half().contiguous(),
            **e.kwargs,
        )


# --- the backend ---------------------------------------------------------------------------------


class ReshapeAndCacheBackend(AscendBackend):
    kv_write_op = RESHAPE_AND_CACHE


def _step(
    requests: list[tuple[int, int]],
    backend_type: type[AscendBackend] = AscendBackend,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[Any, ...]:
    spec = mla_spec(dtype=dtype)
    backend = backend_type(spec, "cpu", emulate=True)
    step = testing.random_mla_step(backend, requests)
    assert step.cache.layout == "split"
    return spec, backend, step.batch, step.cache, step.query, step.kv_c, step.k_pe


@pytest.mark.parametrize("backend_type", [AscendBackend, ReshapeAndCacheBackend])
@pytest.mark.parametrize(
    ("requests", "sparse_mode"),
    [([(1, 17), (1, 3), (1, 40)], 0), ([(3, 20), (1, 9), (16, 16)], 3)],
    ids=["decodes", "multi-token"],
)
def test_a_layer_makes_one_write_and_one_fia_call(
    requests: list[tuple[int, int]], sparse_mode: int, backend_type: type[AscendBackend]
) -> None:
    spec, backend, batch, cache, query, kv_c, k_pe = _step(requests, backend_type)
    want_cache = cache.clone()
    reference.write_latent_kv(want_cache, kv_c, k_pe, batch.slot_mapping)
    meta = backend.metadata_builder().build(batch)
    with emulator.record_calls() as calls:
        out = backend.impl().forward(query, kv_c, k_pe, cache, meta)
    assert [c.name for c in calls] == [backend.kv_write_op, "npu_fused_infer_attention_score.out"]
    fia = calls[1].kwargs
    assert fia["sparse_mode"] == sparse_mode and fia["query_rope"] is not None
    assert (fia["atten_mask"] is None) == (sparse_mode == 0)
    assert cache.equal(want_cache)
    want, _ = reference.paged_mla_absorbed(query, cache, batch, spec)
    n = batch.num_actual_tokens
    assert testing.mismatch(out[:n], want, TOL) is None
    assert bool((out[n:] == 0).all())


def test_write_kv_alone_skips_padding_slots() -> None:
    _, backend, batch, cache, _, kv_c, k_pe = _step([(2, 5), (1, 9)])
    slots = batch.slot_mapping.clone()
    slots[1] = -1  # a real token's write skipped, as padding rows are
    want = cache.clone()
    reference.write_latent_kv(want, kv_c, k_pe, slots)
    backend.impl().write_kv(kv_c, k_pe, cache, slots)
    assert cache.equal(want)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_heads": 8}, "mla.num_heads"),
        ({"block_size": 64}, "mla.block_size"),
        ({"kv_lora_rank": 256}, "mla.latent_size"),
        ({"dtype": torch.float32}, "mla.dtype"),
    ],
)
def test_what_fias_mla_form_does_not_take_is_refused_with_its_reason(
    changes: dict[str, Any], field: str
) -> None:
    reasons = AscendBackend.unsupported_reasons(mla_spec(**changes))
    assert [r.field for r in reasons] == [field]
    with pytest.raises(UnsupportedConfigurationError, match="FIA's MLA form"):
        AscendBackend(mla_spec(**changes), "cpu", emulate=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "requests",
    [[(1, 17), (1, 3), (1, 40)], [(3, 20), (1, 9), (16, 16), (2, 4)]],
    ids=["decodes", "multi-token"],
)
def test_the_lse_comes_from_atbs_mla_op_one_entry_per_query_token(
    requests: list[tuple[int, int]], dtype: torch.dtype
) -> None:
    """return_lse: one write and one ATB MLA call (calc_type_ring), each query token its own
    batch entry with its causal context length; output and LSE are the reference's, the LSE
    float32 within the model dtype's rounding."""
    spec, backend, batch, cache, query, kv_c, k_pe = _step(requests, dtype=dtype)
    meta = backend.metadata_builder().build(batch)
    with emulator.record_calls() as calls:
        out, lse = backend.impl().forward(query, kv_c, k_pe, cache, meta, return_lse=True)
    names = [c.name for c in calls]
    assert names == [backend.kv_write_op, "npu_multi_head_latent_attention.lse_out"]
    atb = calls[1]
    assert atb.kwargs["calc_type"] == "calc_type_ring" and atb.kwargs["return_lse"] is True
    context_lens = atb.args[5]
    want_lens = [s - q + i + 1 for q, s in requests for i in range(q)]
    assert list(context_lens) == want_lens
    want, want_lse = reference.paged_mla_absorbed(query, cache, batch, spec)
    n = batch.num_actual_tokens
    tol = backend.capabilities.mla.tolerance(dtype, backend.capabilities.tolerances)
    assert testing.mismatch(out[:n], want, tol) is None
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (query.shape[0], spec.num_heads)
    assert testing.mismatch(lse[:n], want_lse.t(), tol) is None
    assert bool(torch.isposinf(lse[n:]).all())


def test_the_lse_is_in_the_model_dtypes_precision() -> None:
    """The op's lse is [T, H, 1] in the model dtype [doc, callers]: the float32 LSE is exactly
    a bfloat16 value (what attnhub returns is the op's, converted, not recomputed)."""
    _, backend, batch, cache, query, kv_c, k_pe = _step([(2, 9), (1, 30)])
    meta = backend.metadata_builder().build(batch)
    _, lse = backend.impl().forward(query, kv_c, k_pe, cache, meta, return_lse=True)
    n = batch.num_actual_tokens
    assert lse[:n].equal(lse[:n].bfloat16().float())


def test_the_lse_is_refused_for_a_scale_atbs_op_does_not_take_before_anything_is_written() -> None:
    spec = mla_spec(scale=1.5)
    backend = AscendBackend(spec, "cpu", emulate=True)
    _, _, batch, cache, query, kv_c, k_pe = _step([(1, 9)])
    before = cache.clone()
    meta = backend.metadata_builder().build(batch)
    with pytest.raises(UnsupportedConfigurationError, match=r"return_lse.*\(0, 1\]"):
        backend.impl().forward(query, kv_c, k_pe, cache, meta, return_lse=True)
    assert cache.equal(before)
    backend.impl().forward(query, kv_c, k_pe, cache, meta)  # without the LSE: FIA, served


# --- ATB's MLA op in the emulator ----------------------------------------------------------------


class AtbCall:
    """One npu_multi_head_latent_attention call over random planes, as vllm-ascend makes it."""

    def __init__(self, context_lens: list[int], bs: int = 16, heads: int = N) -> None:
        g = testing.generator(6)
        T = len(context_lens)
        self.ctkv = torch.randn(NB, bs, 1, R, generator=g).bfloat16()
        self.k_rope = torch.randn(NB, bs, 1, P, generator=g).bfloat16()
        self.q_nope = torch.randn(T, heads, R, generator=g).bfloat16()
        self.q_rope = torch.randn(T, heads, P, generator=g).bfloat16()
        blocks = max(1, -(-max(context_lens) // bs))
        perm = torch.randperm(NB, generator=g)[:blocks].to(torch.int32)
        self.table = torch.stack([perm.roll(i) for i in range(T)])
        self.lens = torch.tensor(context_lens, dtype=torch.int32)  # host, as vllm-ascend's
        self.heads, self.bs = heads, bs

    def args(self, **changes: Any) -> list[Any]:
        a: dict[str, Any] = dict(
            q_nope=self.q_nope,
            q_rope=self.q_rope,
            ctkv=self.ctkv,
            k_rope=self.k_rope,
            block_tables=self.table,
            context_lens=self.lens,
            q_headnum=self.heads,
            qk_scale=0.07,
            kv_headnum=1,
        )
        a.update(changes)
        return list(a.values())

    def run(self, lse_dtype: torch.dtype = torch.bfloat16, **changes: Any) -> Any:
        kw = {k: changes.pop(k) for k in list(changes) if k in ("calc_type", "mask_type")}
        T, H = self.q_nope.shape[:2]
        output = torch.empty(T, H, R, dtype=torch.bfloat16)
        lse = torch.empty(T, H, 1, dtype=lse_dtype)
        kw.setdefault("calc_type", "calc_type_ring")
        return emulator.atb.npu_multi_head_latent_attention(
            *self.args(**changes), return_lse=True, **kw, output=output, lse=lse
        )


def test_atbs_mla_op_is_the_absorbed_form_per_token() -> None:
    call = AtbCall([17, 3, 40])
    out, lse = call.run()
    spec = mla_spec(scale=0.07)
    cache = LatentKVCache(
        kv_c=call.ctkv.view(NB, 16, R), k_pe=call.k_rope.view(NB, 16, P), block_size=16,
        layout="split",
    )  # fmt: skip
    batch = BatchMetadata.from_lengths([1, 1, 1], [17, 3, 40], call.table, 16)
    query = torch.cat([call.q_nope, call.q_rope], dim=-1)
    want, want_lse = reference.paged_mla_absorbed(query, cache, batch, spec)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.bfloat16
    assert testing.mismatch(out, want, TOL) is None
    assert testing.mismatch(lse[:, :, 0], want_lse.t(), TOL) is None
    plain = emulator.atb.npu_multi_head_latent_attention(*call.args())  # no lse, the default
    assert plain.equal(out)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"q_headnum": 31}, "q_headnum"),
        ({"kv_headnum": 2}, "kv_headnum"),
        ({"qk_scale": 1.5}, r"qk_scale"),
        ({"context_lens": [17, 3]}, "one batch entry"),
        ({"context_lens": [17, 3, 400]}, "does not fit"),
        ({"calc_type": "calc_type_bogus"}, "calc_type"),
    ],
)
def test_atbs_mla_op_refuses_what_the_doc_refuses(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(NpuOpError, match=match):
        AtbCall([17, 3, 40]).run(**changes)


def test_atbs_mla_op_refuses_blocks_over_128_and_int64_tables() -> None:
    with pytest.raises(NpuOpError, match="block_size <= 128"):
        AtbCall([17, 3], bs=256).run()
    call = AtbCall([17, 3])
    with pytest.raises(NpuOpError, match="int32"):
        call.run(block_tables=call.table.long())


def test_atbs_ring_calc_type_needs_the_lse_and_a_float32_lse_is_not_emulated() -> None:
    call = AtbCall([17, 3])
    with pytest.raises(NpuOpError, match="needs the lse"):
        emulator.atb.npu_multi_head_latent_attention(*call.args(), calc_type="calc_type_ring")
    with pytest.raises(NotEmulatedError, match="float32 lse"):
        call.run(lse_dtype=torch.float32)


class MLAModel:
    """Two MLA layers over their own latent caches on one emulated backend."""

    def __init__(self, backend_type: type[AscendBackend]) -> None:
        self.spec = mla_spec()
        self.backend = backend_type(self.spec, "cpu", emulate=True)
        self.impl = self.backend.impl()
        g = testing.generator(3)
        self.caches = [self.backend.allocate_kv_cache(40) for _ in range(2)]
        for c in self.caches:
            assert isinstance(c, LatentKVCache)
            testing.fill_latent_cache_random(c, g)

    def step(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, meta: Any) -> Any:
        out = q
        for cache in self.caches:
            out = self.impl.forward(q, kv_c, k_pe, cache, meta)
        return out


@pytest.mark.parametrize("backend_type", [AscendBackend, ReshapeAndCacheBackend])
@pytest.mark.parametrize("query_len", [1, 2])
def test_captured_mla_steps_replay_with_each_steps_lengths(
    backend_type: type[AscendBackend], query_len: int
) -> None:
    model = MLAModel(backend_type)
    runner = GraphRunner(
        model.backend,
        model.step,
        capture_sizes=[8],
        max_blocks_per_req=8,
        kv_caches=model.caches,  # type: ignore[arg-type]
    )
    table = testing.shuffled_block_table([8 * 16] * 3, 16, 40, testing.generator(1))
    seqs = [20, 57, query_len]
    for i in range(4):  # every sequence grows by query_len tokens each step: one descriptor
        batch = BatchMetadata.from_lengths([query_len] * 3, seqs, table, 16)
        g = testing.generator(10 + i)
        kv_c, k_pe = testing.random_latent_kv(model.spec, batch.num_tokens, g)
        q = testing.random_mla_query(model.spec, batch.num_tokens, g)
        want_cache = model.caches[1].clone()
        reference.write_latent_kv(want_cache, kv_c, k_pe, batch.slot_mapping)
        out = runner.run(batch, q, kv_c, k_pe).clone()
        assert model.caches[1].equal(want_cache), f"step {i}: the write"
        want, _ = reference.paged_mla_absorbed(q, model.caches[1], batch, model.spec)
        assert testing.mismatch(out, want, TOL) is None, f"step {i}"
        seqs = [n + query_len for n in seqs]
    assert runner.stats == {"captures": 1, "replays": 4}


def test_a_captured_mla_replay_whose_update_is_skipped_answers_for_the_captured_lengths() -> None:
    model = MLAModel(AscendBackend)
    runner = GraphRunner(
        model.backend,
        model.step,
        capture_sizes=[4],
        max_blocks_per_req=8,
        kv_caches=model.caches,  # type: ignore[arg-type]
    )
    table = testing.shuffled_block_table([8 * 16] * 2, 16, 40, testing.generator(1))
    g = testing.generator(4)

    def run(seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor, BatchMetadata]:
        batch = BatchMetadata.from_lengths([1, 1], seqs, table, 16)
        kv_c, k_pe = testing.random_latent_kv(model.spec, 2, g)
        q = testing.random_mla_query(model.spec, 2, g)
        return runner.run(batch, q, kv_c, k_pe).clone(), q, batch

    run([30, 40])

    def events_only(graph_meta: Any, batch: BatchMetadata, stream: Any) -> None:
        for task in graph_meta.graph.tasks:  # the ordering, without the task update
            task.event.record(stream)

    runner.builder.update_graph_params = events_only  # type: ignore[method-assign]
    stale, q, grown = run([31, 41])
    want, _ = reference.paged_mla_absorbed(q, model.caches[1], grown, model.spec)
    assert testing.mismatch(stale, want, TOL) is not None  # the new keys are not attended
    captured = BatchMetadata.from_lengths([1, 1], [30, 40], table, 16)
    want, _ = reference.paged_mla_absorbed(q, model.caches[1], captured, model.spec)
    assert testing.mismatch(stale, want, TOL) is None
