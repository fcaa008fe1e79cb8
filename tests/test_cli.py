"""What a person reads from ``attnhub list / select / bench`` (and how fast ``--help`` answers)."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from attnhub import Capabilities, bench, registry
from attnhub.cli import build_parser, main, sizes
from attnhub.torch_backend import TorchBackend


def caps(**changes: Any) -> Capabilities:
    return dataclasses.replace(TorchBackend.capabilities, **changes)


class MultiplesBackend(TorchBackend):
    """Block sizes: multiples of 16; head sizes: multiples of 8 up to 256."""

    name = "multiples-cli-test"
    capabilities = caps(
        block_size_multiple=16, head_size_multiple=8, max_head_size=256, priority={"cpu": -1}
    )


class NarrowBackend(TorchBackend):
    """Head size 64 only."""

    name = "narrow-cli-test"
    capabilities = caps(head_sizes=frozenset({64}), priority={"cpu": -1})


class VendorBackend(TorchBackend):
    """A "vendor" backend that runs on CPU only through its emulator."""

    name = "vendor-cli-test"
    capabilities = caps(priority={"cpu": -1})

    @classmethod
    def availability(cls, device: torch.device | str, emulate: bool = False) -> str | None:
        return None if emulate else "no vendor device here; emulate to run on the CPU"

    @classmethod
    def is_emulated(cls, device: torch.device | str) -> bool:
        return True


@pytest.fixture
def registered() -> Iterator[None]:
    for cls in (MultiplesBackend, NarrowBackend, VendorBackend):
        registry.register_backend(cls)
    yield
    for cls in (MultiplesBackend, NarrowBackend, VendorBackend):
        registry.default_registry().unregister(cls.name)


def subcommand(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


# --- attnhub --help ------------------------------------------------------------------------------
def test_help_does_not_import_torch():
    code = (
        "import sys\nfrom attnhub.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "False"


@pytest.mark.parametrize("command", ["bench", "select"])
def test_every_option_has_help(command):
    options = [a for a in subcommand(command)._actions if a.option_strings]
    assert options
    assert [a.option_strings for a in options if not a.help] == []


# --- attnhub list --------------------------------------------------------------------------------
def test_sizes_in_words():
    assert sizes(None, 1) == "any"
    assert sizes(None, 16) == "multiples of 16"
    assert sizes(None, 8, 256) == "multiples of 8 up to 256"
    assert sizes(None, 1, 512) == "up to 512"
    assert sizes(frozenset({128, 64, 100}), 32) == "64, 128"


def test_list_shows_size_rules_and_tolerances_and_reads_at_80_columns(
    registered, capsys, monkeypatch
):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["list"]) == 0
    lines = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    assert max(map(len, lines)) <= 80
    start = next(i for i, line in enumerate(lines) if line.startswith("multiples-cli-test"))
    end = next((i for i in range(start, len(lines)) if not lines[i]), len(lines))
    block = lines[start:end]
    assert "  block sizes    multiples of 16" in block
    assert "  head sizes     multiples of 8 up to 256" in block
    assert any("float32 2e-05/2e-05" in line for line in block)


# --- attnhub select ------------------------------------------------------------------------------
SELECT = ["select", "--heads", "8", "--head-size", "128", "--dtype", "float32"]


def test_select_table_ranks_with_ATTNHUB_EMULATE_as_select_does(registered, capsys, monkeypatch):
    monkeypatch.setenv("ATTNHUB_EMULATE", "1")
    assert main([*SELECT, "--prefer", "vendor-cli-test"]) == 0
    out = capsys.readouterr().out
    assert "selected: vendor-cli-test (emulated)" in out
    assert "no vendor device here" not in out


def test_select_prints_a_refusals_reasons_once(registered, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main([*SELECT, "--prefer", "narrow-cli-test"]) == 2
    out = capsys.readouterr().out
    assert "no backend: backend 'narrow-cli-test' cannot serve this configuration" in out
    assert out.count("head_size 128 is not one of [64]") == 1


def test_select_prints_an_unavailable_backends_reason_once(registered, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main([*SELECT, "--prefer", "vendor-cli-test"]) == 2
    out = capsys.readouterr().out
    assert "backend 'vendor-cli-test' is not available on 'cpu'" in out
    assert out.count("no vendor device here") == 1


# --- attnhub bench -------------------------------------------------------------------------------
def test_bench_plot_without_matplotlib_stops_before_benchmarking(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("benchmarked before checking --plot")

    monkeypatch.setattr(bench, "run_case", must_not_run)
    assert main(["bench", "--quick", "--plot", str(tmp_path / "r.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "matplotlib" in err[0] and "pip install 'attnhub[plot]'" in err[0]
    assert not (tmp_path / "r.png").exists()


def test_bench_prints_a_line_per_case_outside_a_terminal(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")

    def fake_run(case: bench.BenchCase, **kwargs: object) -> bench.BenchResult:
        return bench.BenchResult(case.name, "torch", "float32", 2.0, 1.0, 2.0, None, 5.0)

    monkeypatch.setattr(bench, "run_case", fake_run)
    assert main(["bench", "--quick", "--repeats", "1", "--backend", "torch"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "bench [1/5] ceilings: copy bandwidth, matmul FLOP/s",
        f"bench [2/5] decode 8x256 float32: {bench.DENSE}",
        "bench [3/5] decode 8x256 float32: torch",
        f"bench [4/5] prefill 1x256 float32: {bench.DENSE}",
        "bench [5/5] prefill 1x256 float32: torch",
    ]
    assert "decode 8x256" in captured.out  # the table, on stdout
