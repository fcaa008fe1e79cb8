"""Backends and engine integrations import from the core only its public API and the kit
(``attnhub.kit``): everything else in the core may change without them. Read from their
sources (ast), so a lazy import inside a function counts as much as one at the top."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

import attnhub
import attnhub.context_parallel
import attnhub.kit
from attnhub import reference

ROOT = Path(__file__).resolve().parents[1]
#: The packages held to the rule: every backend's and every integration's.
PACKAGES = sorted([*ROOT.glob("backends/*/attnhub_*"), *ROOT.glob("integrations/*/attnhub_*")])
#: Public modules a backend may import whole or from: the kit and the modules the design
#: names (errors, reference, testing).
MODULES = {"attnhub.kit", "attnhub.errors", "attnhub.reference", "attnhub.testing"}
#: Public subpackages with an API of their own (their ``__all__``, documented on their page:
#: docs/context-parallel.md), which an engine integration drives.
SUBPACKAGES = {"attnhub.context_parallel": set(attnhub.context_parallel.__all__)}
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
                elif module in SUBPACKAGES:
                    ok = name in SUBPACKAGES[module]
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


# --- the kit's own helpers ---------------------------------------------------------------------


def test_the_lse_merge_is_the_references_over_empty_and_full_parts() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 3, 8, generator=g), torch.randn(5, 3, 8, generator=g)
    a_lse, b_lse = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    a_lse[0, 1] = b_lse[0, 1] = math.inf  # both parts empty
    a_lse[1, 2] = math.inf  # one empty (+inf, FA2's mark)
    b_lse[2, 3] = -math.inf  # one empty (-inf, FA3's mark)
    merged, lse = attnhub.kit.merge_attn_states(a, a_lse, b, b_lse)
    b_lse_ref = b_lse.masked_fill(torch.isneginf(b_lse), math.inf)  # the reference's mark
    want, want_lse = reference.merge_attn_states(a, a_lse, b, b_lse_ref)
    assert merged.dtype == torch.float32
    torch.testing.assert_close(merged.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-6)
    assert (merged[1, 0] == 0).all() and lse[0, 1] == math.inf


def _planes(strided: bool) -> torch.Tensor:  # [4 blocks, 2 slots, 1 head, 3] float32
    base = torch.arange(4 * 3 * 3, dtype=torch.float32).reshape(4, 3, 1, 3)
    return base[:, :2] if strided else base[:, :2].clone()  # strided: a row between blocks


@pytest.mark.parametrize("strided", [False, True])
def test_write_slots_puts_each_row_in_its_slot_with_or_without_a_flat_view(strided: bool) -> None:
    plane = _planes(strided)
    flat = attnhub.kit.flat_slots(plane)
    assert (flat is None) == strided
    want = plane.clone()
    slots = torch.tensor([5, 0, 2])
    rows = torch.randn(3, 1, 3)
    attnhub.kit.write_slots(plane, flat, slots, rows)
    for row, slot in zip(rows, slots.tolist(), strict=True):
        want[slot // 2, slot % 2] = row
    assert torch.equal(plane, want)
    assert torch.equal(attnhub.kit.read_slots(plane, flat, slots), rows)


def test_a_fixed_shape_write_redirects_padding_to_the_first_written_row() -> None:
    write = attnhub.kit.FixedShapeWrite.of(torch.tensor([-1, 6, -1, 3]))
    assert write.rows.tolist() == [1, 1, 1, 3] and write.slots.tolist() == [6, 6, 6, 3]
    assert bool(write.writes)
    new, held = torch.ones(4, 2), torch.zeros(4, 2)
    assert torch.equal(write.pick(new, held), new)


def test_a_fixed_shape_write_of_padding_only_rewrites_slot_0_with_what_it_holds() -> None:
    write = attnhub.kit.FixedShapeWrite.of(torch.tensor([-1, -1]))
    assert write.slots.tolist() == [0, 0] and not bool(write.writes)
    new, held = torch.ones(2, 2), torch.zeros(2, 2)
    assert torch.equal(write.pick(new, held), held)
