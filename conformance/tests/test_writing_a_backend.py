"""docs/writing-a-backend.md is enough to write a working backend: its code blocks, written out
as the package they describe, register (in-process, through their entry point, and installed
by pip where hatchling is at hand), pass the conformance suite and pass their own tests.

Every code block of the guide whose first line is ``# <path>`` is a file of the example package
(``my_backend/backend.py``, ``my_backend/plugin.py``, ``pyproject.toml``,
``tests/test_my_backend.py``); the guide says ``my_backend/__init__.py`` is empty.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from suite_runs import suite_env, write_distribution

import attnhub
from attnhub.registry import default_registry

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "writing-a-backend.md"
#: A fenced block whose first line names its file: ```python\n# my_backend/backend.py\n...```
FILE_BLOCK = re.compile(r"^```\w+\n# (\S+)\n(.*?)^```", re.S | re.M)
EMPTY = "my_backend/__init__.py"  # the guide: "my_backend/__init__.py  empty"


def guide_files() -> dict[str, str]:
    """Path -> text of each file the guide shows (its ``# <path>`` line kept: a comment)."""
    return {path: f"# {path}\n{body}" for path, body in FILE_BLOCK.findall(GUIDE.read_text())}


def load_toml(text: str) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads(text)


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example package's source tree, as the guide lays it out."""
    root = tmp_path_factory.mktemp("my-attn-backend")
    for path, text in {**guide_files(), EMPTY: ""}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


@pytest.fixture(scope="module")
def installed(package: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A site directory holding the package installed as its pyproject says: the module files
    plus a dist-info whose name, version and entry points come from pyproject.toml (what pip
    would write; test_thirdparty.py installs its backend the same way)."""
    project = load_toml((package / "pyproject.toml").read_text())["project"]
    files = {
        str(path.relative_to(package)): path.read_text()
        for path in (package / "my_backend").glob("*.py")
    }
    return write_distribution(
        tmp_path_factory.mktemp("site"),
        project["name"],
        project["version"],
        files,
        project["entry-points"],
    )


def test_the_guide_shows_every_file_of_the_package() -> None:
    files = guide_files()
    assert set(files) == {
        "my_backend/backend.py",
        "my_backend/plugin.py",
        "pyproject.toml",
        "tests/test_my_backend.py",
    }
    pyproject = load_toml(files["pyproject.toml"])
    assert pyproject["build-system"]["build-backend"] == "hatchling.build"
    assert pyproject["project"]["entry-points"]["attnhub"] == {"mine": "my_backend.plugin"}
    assert pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["my_backend"]
    assert re.search(rf"{re.escape(EMPTY)} +empty", GUIDE.read_text())


def test_register_backend_serves_the_guides_backend_in_one_process(
    package: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(package))
    my_backend = importlib.import_module("my_backend.backend")
    try:
        attnhub.register_backend(my_backend.MyBackend)
        spec = attnhub.AttentionSpec(
            num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float32, block_size=16
        )
        backend = attnhub.select_backend(spec, "cpu", prefer="mine")
        assert type(backend) is my_backend.MyBackend
        assert attnhub.select_backend(spec, "cpu").name == "torch"  # mine is chosen by name
        cache = backend.allocate_kv_cache(8)
        batch = attnhub.BatchMetadata.from_lengths([1, 7], [21, 7], [[3, 5], [6]], 16)
        g = torch.Generator().manual_seed(0)
        q = torch.randn(8, 8, 64, generator=g)
        k, v = torch.randn(8, 2, 64, generator=g), torch.randn(8, 2, 64, generator=g)
        out = backend.impl().forward(q, k, v, cache, backend.metadata_builder().build(batch))
        ref, _ = attnhub.reference.paged_attention(q, cache, batch, spec)
        assert float((out.double() - ref).abs().max()) < 2e-5
        fp8 = attnhub.AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, kv_cache_dtype="fp8")
        (refusal,) = my_backend.MyBackend.unsupported_reasons(fp8)
        assert refusal.field == "kv_cache_dtype"
        assert refusal.endswith("(keys and values are stored in the model dtype)")
    finally:
        default_registry().unregister("mine")
        for name in [m for m in sys.modules if m.split(".")[0] == "my_backend"]:
            del sys.modules[name]


LIST_AND_SELECT = textwrap.dedent("""
    import torch, attnhub
    info = {i.name: i for i in attnhub.list_backends()}["mine"]
    assert info.error is None and info.backend.__name__ == "MyBackend", info
    assert (info.distribution, info.version) == ("my-attn-backend", "0.1.0"), info
    spec = attnhub.AttentionSpec(num_heads=8, num_kv_heads=2, head_size=128,
                                 dtype=torch.bfloat16, block_size=32, sliding_window=40)
    assert attnhub.select_backend(spec, "cpu", prefer="mine").name == "mine"
    print("ok")
""")


def run_python(script: str, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script],
        env=suite_env((site,)),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_guides_backend_is_discovered_through_its_entry_point(installed: Path) -> None:
    proc = run_python(LIST_AND_SELECT, installed)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


def test_the_guides_backend_passes_the_conformance_suite(run_suite, installed: Path) -> None:
    run = run_suite("--attnhub-backend", "mine", extra_path=(installed,), mutants=False)
    assert run.returncode == 0, run.output[-4000:]
    for row in (
        "availability",
        "batch: decode",
        "batch: chunked_prefill",
        "dtype: fp32",
        "dtype: bf16",
        "head size: 128",
        "feature: sliding_window",
        "feature: softcap",
        "strided K/V planes",
        "kv cache writes",
        "invalid inputs",
        "random batches (hypothesis)",
    ):
        assert run.state(row, "mine") == "pass", row
    for row in ("dtype: fp16", "feature: alibi", "feature: sinks", "kv cache: fp8_e4m3"):
        assert run.state(row, "mine") == "not supported", row
    # a CPU-only backend has no device to sync with: the check does not apply (not a refusal)
    assert run.state("no host sync per layer", "mine") == "not applicable"


def test_the_guides_own_tests_pass(package: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=package,
        env=suite_env((package,)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout


def test_the_guides_pyproject_installs_with_pip(package: Path, tmp_path: Path) -> None:
    pytest.importorskip("hatchling", reason="pip builds the package with hatchling, not here")
    site = tmp_path / "site"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            str(package),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run_python(LIST_AND_SELECT, site)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


def test_the_guides_install_steps_ask_no_index_for_an_unpublished_name() -> None:
    """attnhub's distributions are not on PyPI: the guide's package names none of them in an
    extra, and its first pip line that installs the package installs attnhub from a path on
    the same line (pip asks no index for a name given as a path there)."""
    project = load_toml(guide_files()["pyproject.toml"])["project"]
    for extra, requirements in project.get("optional-dependencies", {}).items():
        assert not [r for r in requirements if r.startswith("attnhub")], (extra, requirements)
    lines = [
        line.split("#")[0].split()
        for block in re.findall(r"^```bash\n(.*?)^```", GUIDE.read_text(), re.S | re.M)
        for line in block.splitlines()
        if line.startswith("pip install")
    ]
    first = next(words for words in lines if any(w.startswith((".", "'.")) for w in words))
    assert "path/to/attnhub" in first and "path/to/attnhub/conformance" in first, first
