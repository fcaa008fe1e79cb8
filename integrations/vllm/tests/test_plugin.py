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
