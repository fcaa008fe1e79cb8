"""``import attnhub``: cheap (no torch until a name is used), and every public name where the
design says it is."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import attnhub


def run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_import_attnhub_does_not_import_torch_until_a_name_is_used():
    code = (
        "import sys, attnhub\nprint('torch' in sys.modules)\n"
        "attnhub.AttentionSpec\nprint('torch' in sys.modules)\n"
    )
    assert run(code).split() == ["False", "True"]


@pytest.mark.parametrize("name", sorted(set(attnhub.__all__) - {"__version__"}))
def test_every_public_name_is_the_object_of_its_module(name):
    value = getattr(attnhub, name)
    home = attnhub._HOME.get(name)
    if home is None:  # a submodule: errors, reference
        assert value is importlib.import_module(f"attnhub.{name}")
    else:
        assert value is getattr(importlib.import_module(home), name)
    assert name in dir(attnhub)


def test_submodules_are_reachable_as_attributes_after_a_bare_import():
    assert run("import attnhub\nprint(attnhub.registry.ENV_EMULATE)") == "ATTNHUB_EMULATE"


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        attnhub.no_such_name  # noqa: B018


def test_the_names_type_checkers_see_are_the_names_imported_at_run_time():
    # attnhub/__init__.py's TYPE_CHECKING block (what mypy and readers see) and ``_HOMES`` (what
    # ``__getattr__`` imports, whence ``__all__``) name the same objects in the same modules
    tree = ast.parse(Path(attnhub.__file__).read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name)
        if node.test.id == "TYPE_CHECKING"
    )
    typed: dict[str, str] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module is not None
        for alias in node.names:
            typed[alias.name] = node.module
    submodules = {"errors", "reference"}
    assert {n: m for n, m in typed.items() if n not in submodules} == attnhub._HOME
    assert all(typed[n] == "attnhub" for n in submodules)
    assert sorted(attnhub.__all__) == sorted({"__version__", *typed})
