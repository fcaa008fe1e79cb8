"""The runtime apart from the tooling (issue 25): importing attnhub, discovering every installed
plugin and running a backend load neither vLLM, nor pip, nor the tools (bench, the CLI, the
conformance runner, the contract tests' ``pip download``)."""

from __future__ import annotations

import subprocess
import sys

import attnhub

#: Top-level module names the runtime must never import.
TOOLING_ROOTS = ("vllm", "pip", "pytest", "matplotlib")
#: Tool modules of attnhub's own distributions.
TOOL_MODULES = (
    "attnhub.bench",
    "attnhub.cli",
    "attnhub_conformance.contracts",
    "attnhub_conformance.runner",
    "attnhub_cpu.bench",
    "attnhub_vllm.bench",
)

RUN = """
import importlib.util, sys, torch
import attnhub
attnhub.list_backends()  # every installed plugin loaded, its hooks called
# the tool plugins' modules, as discovery loads them where installed
for name in ("attnhub_conformance.attnhub_plugin", "attnhub_vllm.plugin", "attnhub_cpu.plugin"):
    if importlib.util.find_spec(name.partition(".")[0]) is not None:
        plugin = __import__(name, fromlist=["_"])
        for hook in ("attnhub_commands", "attnhub_bench_comparisons", "attnhub_host_comparisons"):
            getattr(plugin, hook, list)()
spec = attnhub.AttentionSpec(
    num_heads=4, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.float32
)
be = attnhub.select_backend(spec, "cpu", prefer="torch")
cache = be.allocate_kv_cache(4)
batch = attnhub.BatchMetadata.from_lengths([3, 1], [3, 5], torch.tensor([[1], [2]]), 16, "cpu")
meta = be.metadata_builder().build(batch)
q = torch.randn(4, 4, 16)
k = torch.randn(4, 2, 16)
be.impl().forward(q, k, k, cache, meta)
print(" ".join(sorted(sys.modules)))
"""


def _modules_after(code: str) -> set[str]:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return set(proc.stdout.split())


def _tooling(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in TOOLING_ROOTS or m in TOOL_MODULES)


def test_import_attnhub_loads_no_tooling() -> None:
    assert _tooling(_modules_after("import sys, attnhub; print(' '.join(sys.modules))")) == []


def test_discovery_and_a_forward_load_no_tooling() -> None:
    modules = _modules_after(RUN)
    assert "attnhub.registry" in modules and "attnhub.torch_backend.backend" in modules
    assert _tooling(modules) == []


def test_the_core_ships_no_pip_machinery() -> None:
    """``pip download`` (the vendor contract tests' artifact cache) is conformance tooling."""
    core = __import__("pathlib").Path(attnhub.__file__).parent
    offenders = [
        str(p.relative_to(core))
        for p in core.rglob("*.py")
        if "pip download" in p.read_text() or '"pip"' in p.read_text()
    ]
    assert offenders == []
