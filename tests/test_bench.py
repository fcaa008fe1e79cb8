"""The benchmark code runs (its numbers are reported, never asserted: see attnhub bench)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from attnhub import bench
from attnhub.cli import main


def test_quick_cases_report_a_ratio_to_dense_sdpa_measured_in_the_same_run():
    for case in bench.default_cases(quick=True):
        result = bench.run_case(case, repeats=1)
        assert result.backend == "torch"
        assert result.ratio == result.backend_ms / result.dense_ms
        assert result.meets_target is None  # quick shapes carry no target


def test_full_cases_carry_the_target_ratios():
    targets = {(c.name, str(c.dtype)): c.target for c in bench.default_cases()}
    assert targets[("decode 32x2048", "torch.float32")] == 1.5
    assert targets[("prefill 1x2048", "torch.bfloat16")] == 1.15


def test_host_overhead_mode_writes_json(tmp_path):
    out = tmp_path / "host.json"
    assert main(["bench", "--host", "--backend", "torch", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = [r for r in doc["results"] if r["backend"] == "torch"]
    assert [r["step"] for r in rows] == list(bench.HOST_STEPS)
    assert [r["num_reqs"] for r in rows] == [1, 32, 256, 16]
    assert all(r["build_us"] > 0 and r["forward_us"] > 0 and r["null_kernels"] for r in rows)
    assert doc["machine"] == dataclasses.asdict(bench.machine())


def test_quick_run_records_the_machine_in_its_json_and_table(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--repeats", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    where = bench.machine()
    assert doc["machine"]["cpu"] == where.cpu
    assert set(doc["machine"]["isa"]) == {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    assert doc["machine"]["torch_version"] == torch.__version__
    assert [r["case"] for r in doc["results"]] == ["decode 8x256", "prefill 1x256"]
    assert where.describe() in capsys.readouterr().out.replace("\n", " ")


def test_machine_description_names_present_and_missing_isa_flags():
    m = bench.Machine(
        cpu="AMD EPYC",
        isa={"avx2": True, "avx512f": False, "avx512_bf16": False, "amx_bf16": False},
        torch_cpu_capability="AVX2",
        cores=2,
        torch_threads=2,
        torch_version="2.13.0+cpu",
    )
    assert m.describe() == (
        "AMD EPYC, avx2 (no avx512f, avx512_bf16, amx_bf16), 2 cores, 2 torch threads, "
        "torch 2.13.0+cpu"
    )


def test_host_overhead_runs_for_every_installed_backend() -> None:
    """The host bench's shape is one every in-repo backend serves (emulated where needed)."""
    import attnhub

    for info in attnhub.list_backends():
        if info.backend is None or info.availability("cpu", emulate=True) is not None:
            continue
        row = bench.host_overhead("decode x1", backend=info.name, emulate=True)
        assert row.backend.startswith(info.name) and row.forward_us > 0


def test_host_overhead_of_an_emulated_backend_runs_its_ops_with_null_kernels() -> None:
    """Its ops checked their arguments (time counted) and skipped their math."""
    row = bench.host_overhead("mixed x16", backend="ascend", emulate=True)
    assert row.null_kernels and row.op_checks_us > 0 and row.forward_full_us is None


def test_host_plot_draws_the_curve_over_batch_size(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    rows = [
        bench.HostOverhead(name, f"decode x{n}", n, 10.0 * n**0.1, 5.0, 4.0, True)
        for name in ("torch", bench.VLLM_CPU)
        for n in (1, 32, 256)
    ]
    path = tmp_path / "host.png"
    bench.plot_host(rows, str(path), bench.machine())
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
