"""What an installed attnhub gives, however it was installed: editable (``nox -s tests``) or from
wheels with ``--no-index`` (``nox -s wheelhouse``, which runs this file from outside the
checkout). Each check follows the installed distributions, so it holds for any set of them."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

INSTALL_DOC = Path(__file__).resolve().parents[1] / "docs" / "install.md"
CLI = Path(sys.executable).with_name("attnhub")  # the console script beside this interpreter


def attnhub(*args: str) -> str:
    proc = subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def installed_entry_points(group: str) -> dict[str, str]:
    """Entry-point name -> canonical name of the installed distribution that registers it."""
    return {
        ep.name: canonicalize_name(ep.dist.name)
        for ep in metadata.entry_points(group=group)
        if ep.dist is not None
    }


def tool_plugins() -> dict[str, set[str]]:
    """Plugin -> the names of the commands and comparisons it adds (hooks attnhub_commands,
    attnhub_bench_comparisons, attnhub_host_comparisons), as this process discovers them."""
    from attnhub.registry import TOOL_HOOKS, default_registry

    found: dict[str, set[str]] = {}
    for hook in TOOL_HOOKS:
        for tool in default_registry().tools(hook):
            found.setdefault(tool.plugin, set()).add(tool.name)
    return found


def test_attnhub_list_shows_the_backend_of_every_installed_distribution():
    expected = installed_entry_points("attnhub")
    assert expected.get("torch") == "attnhub"  # the built-in backend, through the same group
    listed = {entry["plugin"]: entry for entry in json.loads(attnhub("list", "--json"))}
    tools = tool_plugins()
    for plugin, distribution in expected.items():
        if plugin not in listed and plugin in tools:
            continue  # a plugin that adds commands or comparisons only (it loaded: no error)
        assert plugin in listed, f"{distribution} registers {plugin!r}; attnhub list omits it"
        assert listed[plugin]["error"] is None, listed[plugin]["error"]
        assert canonicalize_name(listed[plugin]["distribution"]) == distribution


def test_attnhub_help_lists_the_command_of_every_installed_distribution():
    from attnhub.registry import default_registry

    text = attnhub("--help")
    commands = [t.name for t in default_registry().tools("attnhub_commands")]
    if "attnhub-conformance" in set(installed_entry_points("attnhub").values()):
        assert "conformance" in commands
    for command in commands:
        assert re.search(rf"^\s+{re.escape(command)}\b", text, re.M), text
    assert "failed to load" not in text


def third_party_requirement_names() -> set[str]:
    """What attnhub, the suite and each installed backend require from outside the repo."""
    distributions = {"attnhub", "attnhub-conformance", *installed_entry_points("attnhub").values()}
    names = set()
    for distribution in distributions:
        for line in metadata.requires(distribution) or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue  # an extra's requirement
            name = canonicalize_name(requirement.name)
            if not name.startswith("attnhub"):
                names.add(name)
    return names


def test_install_doc_installs_every_third_party_dependency_before_the_wheelhouse():
    """docs/install.md installs the dependencies from the usual index, then attnhub's own names
    with --no-index: its dependency line must name exactly what the distributions require."""
    lines = [
        line
        for line in INSTALL_DOC.read_text().splitlines()
        if line.startswith("pip install ") and "# third-party dependencies" in line
    ]
    assert lines
    named = set()
    for line in lines:
        words = shlex.split(line.split("#")[0])[2:]
        requirements = [
            word
            for i, word in enumerate(words)
            if not word.startswith("-") and not words[i - 1].startswith("--index-url")
        ]
        named |= {canonicalize_name(Requirement(word).name) for word in requirements}
    assert named == third_party_requirement_names()


def test_install_doc_takes_torch_from_the_cpu_index_where_it_installs_torch():
    """PyPI's torch is the CUDA build (several GB): every line of the install page that installs
    torch for a CPU machine names PyTorch's CPU index."""
    lines = [
        line
        for line in INSTALL_DOC.read_text().splitlines()
        if re.match(r"(uv )?pip install .*\btorch==", line)
    ]
    assert lines
    for line in lines:
        assert "--index-url https://download.pytorch.org/whl/cpu" in line, line
