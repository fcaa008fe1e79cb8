"""What a person reads from ``attnhub list / select / bench`` (and how fast ``--help`` answers)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from attnhub import Capabilities, bench, cli, registry
from attnhub.cli import build_parser, main, sizes
from attnhub.emulation import emulate_hint, in_terms_of
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
@pytest.mark.parametrize("command", ["list", "select", "bench"])
def test_a_built_in_commands_help_imports_no_torch(command):
    """A built-in command's own arguments load no plugin (``attnhub --help`` does: it lists
    every plugin's commands and every broken plugin)."""
    code = (
        "import sys\nfrom attnhub.cli import main\n"
        f"try:\n    main([{command!r}, '--help'])\nexcept SystemExit:\n    pass\n"
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


def test_list_says_where_the_lse_is_returned_and_why_not(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["list"]) == 0
    lines = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    start = lines.index(next(line for line in lines if line.startswith("torch ")))
    block = lines[start : lines.index("", start) if "" in lines[start:] else len(lines)]
    assert "  lse            bfloat16, float16, float32" in block
    assert any(line.startswith("  lse            no: ") for line in lines)


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


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--backend", "no-such-backend"], "no backend named 'no-such-backend' (known: "),
        (["--json", "{file}/r.json"], "--json {file}/r.json: '{file}' is a file, not a folder"),
        (["--plot", "{file}/r.png"], "--plot {file}/r.png: '{file}' is a file, not a folder"),
        (["--plot", "{file}/sub/r.png"], "--plot {file}/sub/r.png: cannot make its folder"),
        (["--plot", "{tmp}/r.txt"], "matplotlib writes no 'txt' figure"),
    ],
)
def test_bench_refuses_what_it_cannot_do_before_benchmarking(
    tmp_path, capsys, monkeypatch, flags, said
):
    """An unknown backend, an output folder that cannot be made (under a file) or a figure
    format matplotlib does not write: one line naming the value and exit 2, not minutes of
    timing then a traceback."""
    pytest.importorskip("matplotlib")
    (tmp_path / "a-file").write_text("")
    places = {"file": str(tmp_path / "a-file"), "tmp": str(tmp_path)}

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("benchmarked before checking the arguments")

    monkeypatch.setattr(bench, "run_case", must_not_run)
    monkeypatch.setattr(bench, "measure_ceilings", must_not_run)
    assert main(["bench", "--quick", *(f.format(**places) for f in flags)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said.format(**places) in err[0]


def test_bench_makes_a_missing_output_folder(tmp_path, quiet_machine, fake_backend_runs):
    """As ``attnhub conformance --report`` does."""
    out_json = tmp_path / "results" / "today" / "r.json"
    assert (
        main(["bench", "--quick", "--repeats", "1", "--backend", "torch", "--json", str(out_json)])
        == 0
    )
    assert json.loads(out_json.read_text())["results"]


def test_bench_refuses_no_timed_runs(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--repeats", "0"])
    assert exit_.value.code == 2
    assert "argument --repeats: 0: use a positive number of timed runs" in capsys.readouterr().err


@pytest.fixture
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The OS reports an idle machine (bench warns on a loaded one)."""
    monkeypatch.setattr(bench, "load_average", lambda: (0.0, 0.0, 0.0))


@pytest.fixture
def fake_backend_runs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """bench.run_case answers at once (2 ms, spread ``spread`` of the last dict appended)."""
    runs: list[dict[str, object]] = [{"spread": 0.0, "backend": "torch"}]

    def fake_run(case: bench.BenchCase, **kwargs: object) -> bench.BenchResult:
        last = runs[-1]
        return bench.BenchResult(
            case.name, str(last["backend"]), "float32", 2.0, 1.0, 2.0, None, 5.0,
            spread=float(last["spread"]),  # type: ignore[arg-type]
        )  # fmt: skip

    monkeypatch.setattr(bench, "run_case", fake_run)
    return runs


def test_bench_prints_a_line_per_case_outside_a_terminal(capsys, monkeypatch, quiet_machine):
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


def test_bench_and_conformance_run_on_one_thread_unless_told(monkeypatch):
    assert subcommand("bench").parse_args([]).threads == 1
    assert subcommand("bench").parse_args(["--threads", "2"]).threads == 2
    with pytest.raises(SystemExit):
        subcommand("bench").parse_args(["--threads", "0"])


def test_bench_warns_when_the_machine_is_loaded(capsys, monkeypatch, fake_backend_runs, tmp_path):
    monkeypatch.setattr(bench, "load_average", lambda: (7.5, 3.0, 1.0))
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    out_json = tmp_path / "r.json"
    args = ["bench", "--quick", "--repeats", "1", "--backend", "torch", "--json", str(out_json)]
    assert main(args) == 0
    captured = capsys.readouterr()
    said = "the machine is loaded: 1-minute load average 7.50 on 2 cores"
    assert said in captured.err  # before timing
    assert said in captured.out  # and beside the figures
    assert "load average 7.50" in captured.out  # the machine line
    warnings = json.loads(out_json.read_text())["warnings"]
    assert any(said in w for w in warnings)


def test_bench_is_silent_about_load_on_a_quiet_machine(capsys, quiet_machine, fake_backend_runs):
    assert main(["bench", "--quick", "--repeats", "1", "--backend", "torch"]) == 0
    captured = capsys.readouterr()
    assert "warning" not in captured.out + captured.err


def test_bench_reports_each_figures_spread_and_names_unstable_ones(
    capsys, monkeypatch, quiet_machine, fake_backend_runs, tmp_path
):
    monkeypatch.setenv("COLUMNS", "250")
    fake_backend_runs.append({"spread": 0.6, "backend": "torch"})
    out_json = tmp_path / "r.json"
    args = ["bench", "--quick", "--repeats", "1", "--backend", "torch", "--json", str(out_json)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "spread" in out.splitlines()[2] or any("spread" in ln for ln in out.splitlines())
    assert "60%" in out  # the backend rows' spread column
    assert "2 figure(s) spread more than 25%" in " ".join(out.split())
    assert "decode 8x256 float32 torch (60%)" in out
    doc = json.loads(out_json.read_text())
    assert {r["spread"] for r in doc["results"] if r["backend"] == "torch"} == {0.6}
    assert set(doc["ceilings"]["spreads"]) >= {"copy", "matmul float32"}


def test_spread_is_the_range_over_the_median():
    assert bench.spread([1.0, 1.1, 1.5]) == pytest.approx(0.5 / 1.1)
    assert bench.spread([2.0]) == 0.0


def test_bench_tables_are_not_cut_outside_a_terminal(
    capsys, monkeypatch, quiet_machine, fake_backend_runs
):
    monkeypatch.setenv("COLUMNS", "80")
    fake_backend_runs.append({"spread": 0.0, "backend": "a-backend-with-a-rather-long-name"})
    assert main(["bench", "--quick", "--repeats", "1", "--backend", "torch"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    assert "a-backend-with-a-rather-long-name" in out
    assert "of measured ceiling" in out and "achieved" in out


# --- the emulation hint, in each tool's terms ------------------------------------------------
class HintedVendorBackend(VendorBackend):
    """Unavailable on the CPU unless emulated, saying so with the shared hint."""

    name = "hinted-vendor-cli-test"

    @classmethod
    def availability(cls, device: torch.device | str, emulate: bool = False) -> str | None:
        return None if emulate else f"no vendor device here: {emulate_hint()}"


def test_emulate_hint_is_spelt_for_each_audience():
    assert "emulate=True" in emulate_hint() and "ATTNHUB_EMULATE=1" in emulate_hint()
    assert "--emulate" in emulate_hint("cli") and "emulate=True" not in emulate_hint("cli")
    assert "--attnhub-emulate" in emulate_hint("pytest")
    text = f"x: {emulate_hint()}"
    assert in_terms_of(text, "cli") == f"x: {emulate_hint('cli')}"
    assert in_terms_of(in_terms_of(text, "pytest"), "api") == text


def test_select_and_list_give_the_commands_emulate_flag(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    registry.register_backend(HintedVendorBackend)
    try:
        assert main([*SELECT, "--prefer", HintedVendorBackend.name]) == 2
        assert main(["list"]) == 0
    finally:
        registry.default_registry().unregister(HintedVendorBackend.name)
    out = capsys.readouterr().out
    assert out.count(emulate_hint("cli")) >= 2
    assert "emulate=True" not in out


def test_no_installed_backend_tells_command_line_users_a_pytest_flag(capsys, monkeypatch):
    """Every discovered backend that runs on the CPU only emulated: ``attnhub select`` names
    the flag select takes (flash and iluvatar once said --attnhub-emulate, pytest's)."""
    import attnhub

    monkeypatch.setenv("COLUMNS", "300")
    monkeypatch.delenv("ATTNHUB_EMULATE", raising=False)
    names = [
        info.name
        for info in attnhub.list_backends()
        if info.backend is not None
        and info.availability("cpu", emulate=False) is not None
        and info.availability("cpu", emulate=True) is None
    ]
    for name in names:
        main([*SELECT, "--dtype", "bfloat16", "--prefer", name])
        out = capsys.readouterr().out
        assert "--attnhub-" not in out, (name, out)


# --- smaller things a newcomer meets ---------------------------------------------------------
@pytest.mark.parametrize(
    ("given", "meant"),
    [("fp16", "float16"), ("bf16", "bfloat16"), ("fp32", "float32"), ("float16", "float16")],
)
def test_select_takes_short_dtype_names(given, meant):
    assert (
        subcommand("select")
        .parse_args(["--heads", "8", "--head-size", "64", "--dtype", given])
        .dtype
        == meant
    )


def test_select_refuses_an_unknown_dtype_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*SELECT[:-2], "--dtype", "int4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "'int4' is not a dtype" in err and "fp16" in err and "bfloat16" in err


def test_a_refused_spec_is_one_line_naming_the_command_outside_a_terminal(capsys, monkeypatch):
    """A CI log gets the typed error whole on one line (rich once broke it at 80 columns),
    led by the command as argparse's errors are."""
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["select", "--heads", "8", "--head-size", "64", "--kv-cache-dtype", "bogus"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("attnhub select: error: kv_cache_dtype = 'bogus' is unknown; known:")
    assert err[0].endswith("int8_k")


def test_select_help_documents_its_exit_status(capsys):
    with pytest.raises(SystemExit):
        main(["select", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Exit status: 0 a backend was selected" in out and "2 none was" in out


def test_a_missing_conformance_command_names_its_distribution(capsys, monkeypatch):
    monkeypatch.setattr(cli, "plugin_commands", lambda: {})
    assert main(["conformance"]) == 2
    err = capsys.readouterr().err
    assert "comes from attnhub-conformance (attnhub's extra [conformance])" in err
    assert "docs/install.md" in err


def test_version_names_the_installed_attnhub(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"attnhub {metadata.version('attnhub')}"


class QpuBackend(TorchBackend):
    """A backend whose native device type torch does not know until its library loads."""

    name = "qpu-cli-test"
    capabilities = caps(devices=frozenset({"qpu", "cpu"}))


@pytest.mark.parametrize("command", ["list", "select", "bench", "conformance"])
def test_a_device_neither_torch_nor_a_backend_knows_is_a_usage_error(capsys, command):
    """Before, ``attnhub list --device bogus`` printed every backend as unable to run on
    'bogus' and exited 0."""
    extra = ["--heads", "8"] if command == "select" else []
    with pytest.raises(SystemExit) as exit_:
        main([command, *extra, "--device", "bogus"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --device: 'bogus' is not a device" in err
    assert "cpu" in err.split("(declared: ")[1]  # the backends' device types, after torch's


def test_a_device_type_a_backend_declares_is_taken_before_torch_knows_it(capsys):
    registry.register_backend(QpuBackend)
    try:
        assert cli.torch_device("qpu") == "qpu"
        assert cli.torch_device("qpu:1") == "qpu:1"
        assert cli.torch_device("cuda:3") == "cuda:3"  # torch parses it, GPU or not
        for bad in ("qpu:x", "qpu:01", "qpu:\u0663", "qpu:-1"):
            with pytest.raises(argparse.ArgumentTypeError, match="a device index is a number"):
                cli.torch_device(bad)
        for bad in ("cpu:01", "cuda:x"):  # a type torch knows: its own refusal stands
            with pytest.raises(argparse.ArgumentTypeError, match="torch says"):
                cli.torch_device(bad)
        assert main(["list", "--device", "qpu"]) == 0
        assert "on qpu" in capsys.readouterr().out
    finally:
        registry.default_registry().unregister(QpuBackend.name)
    with pytest.raises(argparse.ArgumentTypeError, match="'qpu' is not a device"):
        cli.torch_device("qpu")
