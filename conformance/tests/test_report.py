"""The matrix: cell states from outcomes, and the three file formats."""

from __future__ import annotations

import json

import pytest
from attnhub_conformance.report import Matrix, as_html, as_markdown, render_text, write_report


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
    assert "dtype: bf16" in text and "fail" in text and "a::t[x-2]" in text
    assert "| dtype: bf16 | - | - | **fail** |" in as_markdown(matrix, [])
    assert "<table>" in as_html(matrix, [])
    data = json.loads(write_report(matrix, [], tmp_path / "m.json").read_text())
    assert data["matrix"]["kv cache: int8"]["x"]["state"] == "not supported"
    assert data["failed"] is True
    with pytest.raises(ValueError, match=r"\.json, \.md or \.html"):
        write_report(matrix, [], tmp_path / "m.txt")
