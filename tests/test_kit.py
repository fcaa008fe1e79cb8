"""Backends and engine integrations import from the core only its public API and the kit
(``attnhub.kit``): everything else in the core may change without them. Read from their
sources (ast), so a lazy import inside a function counts as much as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import attnhub
import attnhub.kit

ROOT = Path(__file__).resolve().parents[1]
#: The packages held to the rule: every backend's and every integration's.
PACKAGES = sorted([*ROOT.glob("backends/*/attnhub_*"), *ROOT.glob("integrations/*/attnhub_*")])
#: Public modules a backend may import whole or from: the kit and the modules the design
#: names (errors, reference, testing).
MODULES = {"attnhub.kit", "attnhub.errors", "attnhub.reference", "attnhub.testing"}
#: What ``from attnhub import X`` / ``attnhub.X`` may name.
TOP = {*attnhub.__all__, "kit", "testing"}


def forbidden_imports(source: str) -> list[str]:
    """Each core name ``source`` imports outside the public API and the kit: a public name from
    ``attnhub``, or from the module ``attnhub/__init__.py`` names as its home; a kit name from
    ``attnhub.kit``; anything from ``MODULES``' other modules."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module = node.module
            if module != "attnhub" and not module.startswith("attnhub."):
                continue
            for alias in node.names:
                name = alias.name
                if module == "attnhub":
                    ok = name in TOP
                elif module == "attnhub.kit":
                    ok = name in attnhub.kit.__all__
                elif module in MODULES:
                    ok = True
                else:
                    ok = attnhub._HOME.get(name) == module
                if not ok:
                    found.append(f"line {node.lineno}: from {module} import {name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("attnhub.") and alias.name not in MODULES:
                    found.append(f"line {node.lineno}: import {alias.name}")
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "attnhub"
            and node.attr not in TOP
        ):
            found.append(f"line {node.lineno}: attnhub.{node.attr}")
    return found


def test_every_backend_and_integration_is_checked() -> None:
    names = {p.name for p in PACKAGES}
    assert {"attnhub_ascend", "attnhub_iluvatar", "attnhub_flash", "attnhub_cpu"} <= names
    assert "attnhub_vllm" in names


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_a_backend_imports_only_the_public_api_and_the_kit(package: Path) -> None:
    found = [
        f"{path.relative_to(ROOT)} {where}"
        for path in sorted(package.rglob("*.py"))
        for where in forbidden_imports(path.read_text())
    ]
    assert not found, "core names outside the public API and attnhub.kit:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "from attnhub.validation import StepExtents",  # an undeclared module
        "from attnhub.batch import as_contiguous",  # a public module, a name that is not
        "from attnhub import emulation",  # a submodule not in the API (the kit's now)
        "from attnhub.kit import check_step",  # not a kit name
        "import attnhub.graphs.tape",
        "import attnhub\nattnhub.validation.same_view",
        "def f():\n    from attnhub.graphs import NPUGraphAdaptor",  # lazy, inside a function
    ],
)
def test_the_check_finds_a_name_outside_the_api_and_the_kit(source: str) -> None:
    assert forbidden_imports(source)


@pytest.mark.parametrize(
    "source",
    [
        "from attnhub import AttentionSpec, errors, kit",
        "from attnhub.backend import AttentionBackend",  # a public name from its home
        "from attnhub.spec import KV_CACHE_DTYPES, AttentionType",
        "from attnhub.errors import InvalidInputError",
        "from attnhub.kit import VendorLibrary, emulation, merge_attn_states",
        "from attnhub.testing import blocks_needed",
        "import attnhub\nattnhub.select_backend",
    ],
)
def test_the_check_passes_the_public_api_and_the_kit(source: str) -> None:
    assert forbidden_imports(source) == []


def test_every_kit_name_is_there() -> None:
    for name in attnhub.kit.__all__:
        assert getattr(attnhub.kit, name) is not None, name
