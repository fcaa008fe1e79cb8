"""The benchmark code runs (its numbers are reported, never asserted: see attnhub bench)."""

from __future__ import annotations

import json

from attnhub import bench
from attnhub.cli import main


def test_quick_cases_report_a_ratio_to_dense_sdpa_measured_in_the_same_run():
    for case in bench.default_cases(quick=True):
        result = bench.run_case(case, repeats=1)
        assert result.backend == "torch"
        assert result.ratio == result.backend_ms / result.dense_ms
        assert result.meets_target is None  # quick shapes carry no target


def test_full_cases_carry_the_issue_targets():
    targets = {(c.name, str(c.dtype)): c.target for c in bench.default_cases()}
    assert targets[("decode 32x2048", "torch.float32")] == 1.5
    assert targets[("prefill 1x2048", "torch.bfloat16")] == 1.15


def test_host_overhead_mode_writes_json(tmp_path):
    out = tmp_path / "host.json"
    assert main(["bench", "--host", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["num_reqs"] for r in rows] == [1, 32, 256]
    assert all(r["build_us"] > 0 and r["forward_us"] > 0 for r in rows)
