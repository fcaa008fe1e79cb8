"""The vllm.general_plugins entry point turns on only when asked (no vLLM needed)."""

from __future__ import annotations

import pytest
from attnhub_vllm import plugin


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, False),
        ({"ATTNHUB_BACKEND": "torch"}, True),
        ({"ATTNHUB_VLLM": "1"}, True),
        ({"ATTNHUB_BACKEND": "torch", "ATTNHUB_VLLM": "0"}, False),
    ],
)
def test_enabled_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: bool
) -> None:
    monkeypatch.delenv("ATTNHUB_BACKEND", raising=False)
    monkeypatch.delenv("ATTNHUB_VLLM", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert plugin.enabled() is expected


def test_register_is_a_no_op_when_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off: register() returns before importing vLLM (works where vLLM is absent)."""
    monkeypatch.delenv("ATTNHUB_BACKEND", raising=False)
    monkeypatch.setenv("ATTNHUB_VLLM", "0")
    plugin.register()


def test_core_does_not_import_vllm() -> None:
    import subprocess
    import sys

    code = "import sys, attnhub, attnhub_vllm, attnhub_vllm.mapping; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_register_puts_attnhubs_mla_backend_in_place_of_vllms_cpu_mla_backends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On: MLA layers get attnhub's MLA backend whichever of CPU_MLA / AMX_MLA vLLM's CPU
    platform picks; standard layers keep attnhub's standard backend."""
    pytest.importorskip("vllm")
    from attnhub_vllm import BACKEND_CLASS_PATH, MLA_BACKEND_CLASS_PATH
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    monkeypatch.setenv("ATTNHUB_BACKEND", "torch")
    members = [E.CUSTOM, E.CPU_ATTN, E.CPU_MLA, E.AMX_MLA]
    before = {m: m.is_overridden() for m in members}
    try:
        plugin.register()
        assert E.CPU_MLA.get_path() == E.AMX_MLA.get_path() == MLA_BACKEND_CLASS_PATH
        assert E.CPU_ATTN.get_path() == E.CUSTOM.get_path() == BACKEND_CLASS_PATH
        mla = E.CPU_MLA.get_class()
        assert mla.is_mla() and mla.get_name() == "CPU_MLA"
    finally:
        for m in members:
            if not before[m]:
                m.clear_override()
