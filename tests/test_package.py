"""``import attnhub``: cheap (no torch until a name is used), and every public name where the
design says it is."""

from __future__ import annotations

import importlib
import subprocess
import sys

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
