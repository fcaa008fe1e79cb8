"""The matrix: cell states from outcomes, and the three file formats."""

from __future__ import annotations

import json
from html import escape

import pytest
from attnhub_conformance.report import (
    LEGEND,
    Matrix,
    as_html,
    as_json,
    as_markdown,
    render_text,
    write_report,
)
from attnhub_conformance.targets import Target

from attnhub.torch_backend import TorchBackend


def facts(backend: str, rows: list[str], status: str = "native", not_supported: bool = False):
    return {
        "backend": backend,
        "rows": rows,
        "status": status,
        "not_supported": not_supported,
        "reason": None,
    }


@pytest.fixture
def matrix() -> Matrix:
    m = Matrix("quick", "cpu")
    m.record("a::t[x-1]", "call", "passed", facts("x", ["batch: decode", "dtype: bf16"]), None)
    m.record("a::t[x-2]", "call", "failed", facts("x", ["dtype: bf16"]), "boom")
    m.record(
        "a::t[x-3]", "call", "passed", facts("x", ["kv cache: int8"], not_supported=True), None
    )
    m.record(
        "a::t[v-1]", "setup", "skipped", facts("v", ["availability"], "unavailable"), "no hardware"
    )
    m.record("a::t[e-1]", "call", "passed", facts("e", ["batch: decode"], "emulated"), None)
    return m


def test_cell_states(matrix: Matrix) -> None:
    cells = matrix.cells()
    assert cells[("batch: decode", "x")].state == "pass"
    assert cells[("dtype: bf16", "x")].state == "fail"
    assert cells[("dtype: bf16", "x")].failures == ["a::t[x-2]"]
    assert cells[("kv cache: int8", "x")].state == "not supported"
    assert cells[("availability", "v")].state == "unavailable"
    assert cells[("batch: decode", "e")].state == "emulated"
    assert matrix.rows == ["availability", "batch: decode", "dtype: bf16", "kv cache: int8"]
    # a backend that did not run at all shows as unavailable on every row
    assert matrix.cell(cells, "batch: decode", "v", "unavailable").state == "unavailable"


def test_formats(matrix: Matrix, tmp_path) -> None:
    text = render_text(matrix, [], width=120)
    assert "dtype: bf16" in text and "fail 1/2" in text
    assert "rerun one: pytest --pyargs attnhub_conformance -k '<case>'" in text
    assert "\n  t[x-2]\n" in text  # what -k selects the case by, not its node id
    assert "| dtype: bf16 | - | - | **fail 1/2** |" in as_markdown(matrix, [])
    assert "<table>" in as_html(matrix, [])
    data = json.loads(write_report(matrix, [], tmp_path / "m.json").read_text())
    assert data["matrix"]["kv cache: int8"]["x"]["state"] == "not supported"
    assert data["failed"] is True
    with pytest.raises(ValueError, match=r"\.json, \.md or \.html"):
        write_report(matrix, [], tmp_path / "m.txt")


def test_markdown_and_html_carry_counts_a_legend_and_the_tolerances(matrix: Matrix) -> None:
    m = Matrix("quick", "cpu")
    for i in range(3):
        m.record(f"a::t[torch-{i}]", "call", "passed", facts("torch", ["batch: decode"]), None)
    targets = [Target("torch", "cpu", emulate=False, backend=TorchBackend)]
    md = as_markdown(m, targets)
    assert "| batch: decode | pass 3/3 |" in md
    for state, meaning in LEGEND.items():
        assert f"- **{state}**: {meaning}" in md
    assert "| torch | float32 | 2e-05 | 2e-05 |" in md
    html = as_html(m, targets)
    assert ">pass 3/3</td>" in html
    assert "<h2>Legend</h2>" in html
    assert all(escape(meaning) in html for meaning in LEGEND.values())
    assert "<td>torch</td><td>bfloat16</td><td>0.02</td><td>0.02</td>" in html
    tolerances = as_json(m, targets)["backends"]["torch"]["tolerances"]
    assert tolerances["float16"] == {"atol": 0.003, "rtol": 0.003}


def test_a_check_that_does_not_apply_is_not_applicable_not_refused() -> None:
    m = Matrix("quick", "cpu")
    why = "not applicable here: the backend declares the CPU as its only device"
    m.record(
        "a::t[c-1]", "setup", "skipped", {**facts("c", ["no host sync per layer"]),
                                          "not_applicable": True}, why
    )  # fmt: skip
    cell = m.cells()[("no host sync per layer", "c")]
    assert cell.state == "not applicable" and cell.state != "not supported"
    assert "not applicable" in LEGEND
    assert m.skip_reasons() == [("c", why, 1)]


def test_skip_reasons_reach_every_report(tmp_path) -> None:
    m = Matrix("quick", "cpu")
    for i in range(2):
        m.record(f"a::t[x-{i}]", "setup", "skipped", facts("x", ["kv cache: fp8"]), "no bound | x")
    m.record("a::t[x-9]", "call", "passed", facts("x", ["batch: decode"]), None)
    for case in ("x-graphs-a", "x-graphs-b"):  # a reason that names its case groups without it
        m.record(f"a::g[{case}]", "call", "skipped", facts("x", ["graphs"]), f"{case}: no update")
    assert ("x", "no update", 2) in m.skip_reasons()
    text = render_text(m, [], width=80)
    assert "x: no bound | x (2)" in text
    assert "| x | no bound \\| x | 2 |" in as_markdown(m, [])
    assert "<td>no bound | x</td><td>2</td>" in as_html(m, [])
    skips = as_json(m, [])["skip_reasons"]
    assert {"backend": "x", "reason": "no bound | x", "tests": 2} in skips


def test_the_matrix_names_the_provider_that_ran() -> None:
    class ProviderBackend(TorchBackend):
        name = "providers"
        provider = "fa2"

    m = Matrix("quick", "cpu")
    m.record("a::t[p-1]", "call", "passed", facts("providers", ["batch: decode"], "emulated"), None)
    targets = [
        Target("providers", "cpu", emulate=True, backend=ProviderBackend, emulated=True,
               provider="fa2")
    ]  # fmt: skip
    assert "providers (emulated, provider fa2)" in as_markdown(m, targets)
    assert "emulated, provider fa2" in as_html(m, targets)
    assert as_json(m, targets)["backends"]["providers"]["provider"] == "fa2"
    assert "provider fa2" in render_text(m, targets, width=80)


def test_the_matrix_is_not_cut_outside_a_terminal() -> None:
    m = Matrix("quick", "cpu")
    names = [f"a-backend-with-a-long-name-{i}" for i in range(5)]
    for name in names:
        for i in range(28):
            m.record(f"a::t[{name}-{i}]", "call", "passed", facts(name, ["batch: decode"],
                                                                  "emulated"), None)  # fmt: skip
    text = render_text(m, [], width=80)
    assert "…" not in text
    assert all(name in text for name in names)
    assert text.count("emulated 28/28") == 5


def test_the_new_rows_sit_in_their_sections_in_order() -> None:
    m = Matrix("full", "cpu")
    rows = [
        "extreme logits: very negative ALiBi",
        "long context: decode 128k",
        "non-contiguous q/k/v and output",
        "extreme logits: scores ~1e4",
        "long context: past the split threshold",
        "output buffer",
        "invalid inputs",
    ]
    for i, row in enumerate(rows):
        m.record(f"a::t[x-{i}]", "call", "passed", facts("x", [row]), None)
    assert m.rows == [
        "output buffer",
        "long context: past the split threshold",
        "long context: decode 128k",
        "non-contiguous q/k/v and output",
        "extreme logits: scores ~1e4",
        "extreme logits: very negative ALiBi",
        "invalid inputs",
    ]
