"""Commands plugins add to ``attnhub`` (hook ``attnhub_commands``, found by the one plugin
discovery), the deprecated entry-point group ``attnhub.cli`` loaded the same way, one report of
broken plugins, and the dependency direction: the core never names the conformance suite, which
adds its command this way."""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

import attnhub
from attnhub import registry
from attnhub.cli import main

CORE = Path(attnhub.__file__).resolve().parent

FAKE_PLUGIN = """
import attnhub
from attnhub.hookspecs import Command

def main(argv):
    print("hello", *argv)
    return 3

@attnhub.hookimpl
def attnhub_commands():
    return [Command("hello", "say hello (a test command)", main)]
"""

FAKE_LIST = """
import attnhub
from attnhub.hookspecs import Command

@attnhub.hookimpl
def attnhub_commands():
    return [Command("list", "a built-in's name", lambda argv: 0)]
"""

FAKE_NOT_A_LIST = """
import attnhub

@attnhub.hookimpl
def attnhub_commands():
    return ("hello", print)
"""

LEGACY = """
def command():
    return "say hi (an old-style command)", main

def main(argv):
    print("hi", *argv)
    return 4

def not_a_pair():
    return main
"""


@pytest.fixture
def installed(tmp_path: Path) -> Iterator[object]:
    """``installed({"hello": "fake_hello"}, attnhub_cli={...})``: a distribution with these
    entry points in group ``attnhub`` (and ``attnhub.cli``) is installed for this test, the
    default registry rediscovered (and again, without it, afterwards)."""
    modules = {
        "fake_hello": FAKE_PLUGIN,
        "fake_list": FAKE_LIST,
        "fake_not_a_list": FAKE_NOT_A_LIST,
        "fake_legacy": LEGACY,
    }

    def install(entry_points: dict[str, str], attnhub_cli: dict[str, str] | None = None) -> None:
        for name, text in modules.items():
            (tmp_path / f"{name}.py").write_text(text)
        info = tmp_path / "fake_commands-1.2.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-commands\nVersion: 1.2\n")
        text = "[attnhub]\n" + "".join(f"{n} = {v}\n" for n, v in entry_points.items())
        if attnhub_cli:
            text += "[attnhub.cli]\n" + "".join(f"{n} = {v}\n" for n, v in attnhub_cli.items())
        (info / "entry_points.txt").write_text(text)
        sys.path.insert(0, str(tmp_path))
        registry.default_registry().discover(force=True)

    yield install
    if str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))
    for name in modules:
        sys.modules.pop(name, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        registry.default_registry().discover(force=True)


def test_core_source_never_names_the_conformance_suite():
    offenders = [
        str(path.relative_to(CORE.parent))
        for path in CORE.rglob("*")
        if path.is_file()
        and path.suffix in (".py", ".pyi", ".toml", ".txt", ".json")
        and any(
            name in path.read_text(encoding="utf-8", errors="replace")
            for name in ("attnhub_conformance", "attnhub-conformance")
        )
    ]
    assert offenders == []


def test_a_plugins_command_runs_with_the_arguments_after_its_name(installed, capsys):
    installed({"hello": "fake_hello"})
    assert main(["hello", "a", "--b"]) == 3
    assert capsys.readouterr().out == "hello a --b\n"


def test_plugin_commands_are_listed_in_help_with_their_distribution(installed, capsys):
    installed({"hello": "fake_hello"})
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "hello say hello (a test command) [fake-commands 1.2]" in out


def test_a_broken_plugin_is_reported_once_by_help_list_and_its_command(
    installed, capsys, monkeypatch
):
    """One discovery, one fault isolation, one report: the plugin that fails to import is
    named with its error by ``--help`` and ``list``, and running it says so in one line; the
    other commands, built-in and installed, still work."""
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps help at hyphens
    installed({"broken": "no_such_module_here", "hello": "fake_hello"})
    assert main(["broken", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "'broken'" in err[0] and "fake-commands 1.2" in err[0]
    assert "ModuleNotFoundError" in err[0] and "no_such_module_here" in err[0]
    assert main(["hello"]) == 3
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Plugins that failed to load: broken [fake-commands 1.2]" in out
    assert "ModuleNotFoundError" in out and "hello say hello" in out
    assert main(["list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert "no_such_module_here" in rows["broken"]["error"] and rows["torch"]["error"] is None


def test_a_hook_that_breaks_the_contract_is_a_broken_plugin(installed, capsys):
    installed({"odd": "fake_not_a_list"})
    assert main(["odd"]) == 2
    err = capsys.readouterr().err
    assert "'odd'" in err and "attnhub_commands() returned ('hello'" in err
    assert "not a list of attnhub.hookspecs.Command" in err


def test_a_built_in_command_runs_whatever_a_plugin_does(installed, capsys):
    installed({"broken": "no_such_module_here"})
    assert main(["select", "--heads", "2", "--head-size", "16", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("selected: torch") and "no_such_module_here" in out


def test_a_plugin_command_cannot_replace_a_built_in_one(installed, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps help at hyphens
    installed({"fakelist": "fake_list"})
    assert main(["list", "--json"]) == 0
    assert "a built-in's name" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Ignored: 'list' from fake-commands 1.2 (a built-in command's name)" in out


def test_the_deprecated_entry_point_group_still_adds_commands(installed, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps help at hyphens
    installed({}, attnhub_cli={"hi": "fake_legacy:command", "odd": "fake_legacy:not_a_pair"})
    assert main(["hi", "there"]) == 4
    assert capsys.readouterr().out == "hi there\n"
    assert main(["odd"]) == 2
    err = capsys.readouterr().err
    assert "'odd'" in err and "expected (help: str, main: callable)" in err
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "hi say hi (an old-style command) [fake-commands 1.2]" in out
    assert "odd [fake-commands 1.2]" in out  # broken: reported with the others


def test_the_runtime_never_loads_the_deprecated_groups(installed):
    installed({}, attnhub_cli={"hi": "fake_legacy:command"})
    reg = registry.default_registry()
    reg.infos()
    assert "fake_legacy" not in sys.modules
    assert [t.name for t in reg.tools("attnhub_commands") if t.plugin.endswith(":hi")] == ["hi"]


def test_an_unknown_command_names_the_known_ones_and_where_others_come_from(capsys):
    assert main(["lst"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'lst' (known: list, select, bench" in err
    assert "did you mean 'list'?" in err
    assert "hook attnhub_commands" in err
