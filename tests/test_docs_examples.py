"""The pages' complete examples run as written and print what their pages say (the README's
has tests/test_readme.py; docs/writing-a-backend.md's package has the suite's
test_writing_a_backend.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import attnhub

DOCS = Path(__file__).resolve().parents[1] / "docs"


def first_python_block(page: str) -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", (DOCS / page).read_text(), re.S | re.M)
    assert blocks, f"docs/{page} has no python example"
    return blocks[0]


def run_example(page: str) -> dict[str, object]:
    namespace: dict[str, object] = {"__name__": f"docs_{page.replace('-', '_')}"}
    exec(compile(first_python_block(page), str(DOCS / page), "exec"), namespace)
    return namespace


def test_graphs_example_captures_once_and_replays(capsys) -> None:
    run_example("graphs.md")
    assert capsys.readouterr().out.strip() == "(2, 8, 64) {'captures': 1, 'replays': 1}"


def test_torch_compile_example_runs_every_step(capsys) -> None:
    try:
        namespace = run_example("torch-compile.md")
    finally:
        attnhub.unregister_layer("layers.0.attn")
        torch._dynamo.reset()
    steps = namespace["steps"]
    said = capsys.readouterr().out.strip().splitlines()
    assert said == [f"{b.num_tokens} tokens -> ({b.num_tokens}, 256)" for b in steps]  # type: ignore[attr-defined]


@pytest.mark.parametrize("page", ["mla.md", "backends/flash.md"])
def test_examples_import_what_they_use(page: str) -> None:
    """A block that spells ``torch.`` or ``attnhub.`` imports it (a reader pastes one block)."""
    for block in re.findall(r"^```python\n(.*?)^```", (DOCS / page).read_text(), re.S | re.M):
        code = re.sub(r"^(from|import) .*$", "", block, flags=re.M)
        for module in ("torch", "attnhub"):
            if re.search(rf"(?<![\w.]){module}\.", code):
                assert re.search(rf"^import (.*\W)?{module}\b", block, re.M), (
                    f"docs/{page}: a block uses {module}. without importing it:\n{block}"
                )
