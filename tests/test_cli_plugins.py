"""Commands other distributions add to ``attnhub`` (entry-point group ``attnhub.cli``), and the
dependency direction: the core never names the conformance suite, which adds its command this
way."""

from __future__ import annotations

from pathlib import Path

import pytest

import attnhub
from attnhub.cli import main

CORE = Path(attnhub.__file__).resolve().parent

FAKE_COMMANDS = """
def command():
    return "say hello (a test command)", main

def main(argv):
    print("hello", *argv)
    return 3

def not_a_pair():
    return main
"""


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``installed({"hello": "fake_commands:command"})``: a distribution with these entry points
    in group ``attnhub.cli`` is importable (on sys.path) for this test."""

    def install(entry_points: dict[str, str]) -> None:
        (tmp_path / "fake_commands.py").write_text(FAKE_COMMANDS)
        info = tmp_path / "fake_commands-1.2.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-commands\nVersion: 1.2\n")
        lines = [f"{name} = {value}" for name, value in entry_points.items()]
        (info / "entry_points.txt").write_text("[attnhub.cli]\n" + "\n".join(lines) + "\n")
        monkeypatch.syspath_prepend(str(tmp_path))

    return install


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


def test_an_installed_command_runs_with_the_arguments_after_its_name(installed, capsys):
    installed({"hello": "fake_commands:command"})
    assert main(["hello", "a", "--b"]) == 3
    assert capsys.readouterr().out == "hello a --b\n"


def test_installed_commands_are_listed_in_help_with_their_distribution(installed, capsys):
    installed({"hello": "fake_commands:command"})
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "hello say hello (a test command) [fake-commands 1.2]" in out


def test_a_command_that_fails_to_load_is_reported_in_one_line(installed, capsys):
    installed({"broken": "no_such_module_here:command", "hello": "fake_commands:command"})
    assert main(["broken", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "'broken'" in err[0] and "fake-commands 1.2" in err[0]
    assert "ModuleNotFoundError" in err[0] and "no_such_module_here" in err[0]
    # the other commands, built-in and installed, still work
    assert main(["hello"]) == 3
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "broken failed to load: no_such_module_here:command: ModuleNotFoundError" in out


def test_a_command_that_breaks_the_contract_is_reported(installed, capsys):
    installed({"odd": "fake_commands:not_a_pair"})
    assert main(["odd"]) == 2
    err = capsys.readouterr().err
    assert "'odd'" in err and "expected (help: str, main: callable)" in err


def test_a_built_in_command_never_loads_installed_ones(installed, capsys):
    installed({"broken": "no_such_module_here:command"})
    assert main(["list", "--json"]) == 0
    assert "no_such_module_here" not in capsys.readouterr().err


def test_an_installed_command_cannot_replace_a_built_in_one(installed, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps help at hyphens
    installed({"list": "fake_commands:command"})
    assert main(["list", "--json"]) == 0
    assert "hello" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Ignored: 'list' from fake-commands 1.2 (a built-in command's name)" in out


def test_an_unknown_command_names_the_known_ones_and_where_others_come_from(capsys):
    assert main(["lst"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'lst' (known: list, select, bench" in err
    assert "did you mean 'list'?" in err
    assert "'attnhub.cli'" in err
