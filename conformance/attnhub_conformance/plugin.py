"""The pytest plugin (entry point ``pytest11``): options, case generation, the matrix.

    pytest --pyargs attnhub_conformance --attnhub-backend torch [--attnhub-scope full]
           [--attnhub-emulate] [--attnhub-device cpu] [--attnhub-report matrix.json]
           [--attnhub-allow-unavailable] [--attnhub-hypothesis-seed N|random]

Installed plugins load in every pytest session; this one stays inert (options only, nothing
imported beyond pytest) until a test marked ``attnhub_cases`` is collected.

A run must test something: a backend it had to test that cannot run (named with
``--attnhub-backend`` and unavailable on the device, every backend of a default run in which
none can run, or a plugin that failed to load) fails its availability test, and the session
exits with ``EXIT_BACKEND_CANNOT_RUN`` when nothing else failed.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from attnhub_conformance.cases import Case, Scope
    from attnhub_conformance.report import Matrix
    from attnhub_conformance.targets import Target

MARKER = "attnhub_cases"
#: The marker of the cases that spawn process groups (``test_multi_rank``).
MULTI_RANK_MARKER = "multi_rank"
PROPERTY = "attnhub"  # the user_properties key a test's matrix facts travel under
#: The exit status of a session whose only failures are backends it had to test that cannot
#: run here (pytest's own statuses are 0-5: 1 = tests failed, 4 = usage error).
EXIT_BACKEND_CANNOT_RUN = 6
#: The statuses it replaces: passed, failed (only on "cannot run"), nothing collected (-k).
_REPLACEABLE = (
    pytest.ExitCode.OK,
    pytest.ExitCode.TESTS_FAILED,
    pytest.ExitCode.NO_TESTS_COLLECTED,
)
#: The property test's seed unless ``--attnhub-hypothesis-seed`` says otherwise: a run that
#: passed (in CI, say) passes again, and a failure is the same failure on every rerun.
DEFAULT_HYPOTHESIS_SEED = 0
#: The soak's steps and the fuzz's examples per backend in a default run: a few seconds each
#: per backend (``nox -s soak`` runs the long ones).
DEFAULT_SOAK_STEPS = 300
DEFAULT_FUZZ_EXAMPLES = 130


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attnhub", "attnhub conformance suite")
    group.addoption(
        "--attnhub-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="backend to test (repeatable; default: every discovered backend)",
    )
    group.addoption(
        "--attnhub-emulate",
        action="store_true",
        default=False,
        help="run vendor backends through their CPU emulators where the hardware is absent",
    )
    group.addoption(
        "--attnhub-allow-unavailable",
        action="store_true",
        default=False,
        help="report a backend named with --attnhub-backend that cannot run on the device as "
        "unavailable instead of failing the run (likewise a default run where none can run)",
    )
    group.addoption(
        "--attnhub-device",
        default="cpu",
        metavar="DEVICE",
        help="device to run the backends on (default: cpu)",
    )
    group.addoption(
        "--attnhub-scope",
        choices=("quick", "full"),
        default="quick",
        help="quick: every declared feature and batch shape, few combinations (default); "
        "full: the wider matrix",
    )
    group.addoption(
        "--attnhub-report",
        action="append",
        default=[],
        metavar="PATH",
        help="write the features x backends matrix to PATH (.json, .md or .html; repeatable)",
    )
    group.addoption(
        "--attnhub-hypothesis-examples",
        type=int,
        default=15,
        metavar="N",
        help="examples per backend for the random-batch property test (default: 15)",
    )
    group.addoption(
        "--attnhub-soak-steps",
        type=int,
        default=DEFAULT_SOAK_STEPS,
        metavar="N",
        help=f"engine steps of the soak per backend (default: {DEFAULT_SOAK_STEPS}; "
        "nox -s soak runs 10000)",
    )
    group.addoption(
        "--attnhub-fuzz-examples",
        type=int,
        default=DEFAULT_FUZZ_EXAMPLES,
        metavar="N",
        help=f"examples of the API fuzz per backend (default: {DEFAULT_FUZZ_EXAMPLES})",
    )
    group.addoption(
        "--attnhub-soak-seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of the soak and of the API fuzz (default 0: every run makes the same steps)",
    )
    group.addoption(
        "--attnhub-hypothesis-seed",
        default=str(DEFAULT_HYPOTHESIS_SEED),
        metavar="N|random",
        help="seed of the random-batch property test: an integer (default "
        f"{DEFAULT_HYPOTHESIS_SEED}: every run draws the same examples), or 'random' (a fresh "
        "seed per run, printed at the end and in a failure so that it can be rerun)",
    )


class SuiteState:
    """Per-config state and the hooks that need it: resolved targets, the matrix being filled,
    the terminal table and the report files."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self._targets: list[Target] | None = None
        self._matrix: Matrix | None = None
        self._cases: dict[tuple[str, str], list[Case]] = {}
        self._other_failures = 0  # failed test phases other than "this backend cannot run"
        self._said_cannot_run: set[str] = set()  # backends whose availability test said so
        self._hypothesis_seed: int | None = None
        self._seeded: set[str] = set()  # node ids of the tests that asked for the seed
        self._seeded_failed = False  # one of them failed
        self.figures: list[str] = []  # the soak's and the fuzz's summaries, for the terminal

    @property
    def hypothesis_seed_is_random(self) -> bool:
        return self.config.getoption("attnhub_hypothesis_seed") == "random"

    @property
    def hypothesis_seed(self) -> int:
        """The session's seed for the property test: the option's integer, or for ``random``
        one drawn once per session (every backend's property test uses the same N)."""
        if self._hypothesis_seed is None:
            if self.hypothesis_seed_is_random:
                self._hypothesis_seed = secrets.randbelow(2**32)
            else:
                self._hypothesis_seed = _parse_seed(
                    self.config.getoption("attnhub_hypothesis_seed")
                )
        return self._hypothesis_seed

    @property
    def scope(self) -> Scope:
        from attnhub_conformance.cases import SCOPES

        return SCOPES[self.config.getoption("attnhub_scope")]

    @property
    def targets(self) -> list[Target]:
        if self._targets is None:
            from attnhub_conformance.targets import resolve_targets

            try:
                self._targets = resolve_targets(
                    self.config.getoption("attnhub_backend"),
                    self.config.getoption("attnhub_device"),
                    self.config.getoption("attnhub_emulate"),
                    allow_unavailable=self.config.getoption("attnhub_allow_unavailable"),
                )
            except LookupError as exc:
                raise pytest.UsageError(str(exc)) from None
        return self._targets

    @property
    def matrix(self) -> Matrix:
        if self._matrix is None:
            from attnhub_conformance.report import Matrix

            self._matrix = Matrix(
                scope=self.config.getoption("attnhub_scope"),
                device=self.config.getoption("attnhub_device"),
            )
        return self._matrix

    @property
    def cannot_run(self) -> list[Target]:
        """The targets that fail the run without being tested (see ``Target.cannot_run``);
        empty when the session resolved no targets (the plugin stayed inert)."""
        return [t for t in self._targets or () if t.cannot_run is not None]

    @property
    def unsaid_cannot_run(self) -> list[Target]:
        """Those of ``cannot_run`` whose availability test did not run to say so (``-k``)."""
        return [t for t in self.cannot_run if t.name not in self._said_cannot_run]

    @property
    def has_results(self) -> bool:
        return self._matrix is not None and bool(self._matrix.results)

    def cases(self, kind: str) -> list[Case]:
        from attnhub_conformance.cases import generate

        out = []
        for target in self.targets:
            key = (kind, target.name)
            if key not in self._cases:
                self._cases[key] = generate(kind, target, self.scope)
            out += self._cases[key]
        return out

    # --- hooks ---------------------------------------------------------------------------
    def pytest_sessionstart(self) -> None:
        # Resolve named backends now (after every plugin's pytest_configure, so in-process
        # registrations count): an unknown name is a usage error, not a collection error.
        if self.config.getoption("attnhub_backend"):
            self.targets  # noqa: B018

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        cannot_run = False
        for key, facts in report.user_properties:
            if key == PROPERTY and isinstance(facts, dict):
                self.matrix.record(
                    report.nodeid, report.when, report.outcome, facts, _short_reason(report)
                )
                cannot_run = bool(facts.get("cannot_run"))
                if cannot_run and report.failed:
                    self._said_cannot_run.add(facts["backend"])
        if report.failed and not cannot_run:
            self._other_failures += 1
        if report.failed and report.nodeid in self._seeded:
            self._seeded_failed = True

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self._seeded and (self.hypothesis_seed_is_random or self._seeded_failed):
            terminalreporter.write_line(
                f"attnhub: the property test drew its examples with hypothesis seed "
                f"{self.hypothesis_seed}; --attnhub-hypothesis-seed {self.hypothesis_seed} "
                "draws them again"
            )
        if self.figures:
            terminalreporter.write_sep("=", "attnhub soak and API fuzz")
            for line in self.figures:
                terminalreporter.write_line(line)
        if self.unsaid_cannot_run:
            terminalreporter.write_sep("=", "attnhub: backends this run had to test cannot run")
            for target in self.unsaid_cannot_run:
                terminalreporter.write_line(str(target.cannot_run))
        if not self.has_results:
            return
        from attnhub_conformance.report import render_text

        tw = self.config.get_terminal_writer()
        terminalreporter.write_sep("=", "attnhub conformance matrix")
        terminalreporter.write(
            render_text(self.matrix, self.targets, width=tw.fullwidth, color=tw.hasmarkup)
        )

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(self.config, "workerinput"):  # an xdist worker: the controller reports
            return
        # A run that could not test a backend it had to never passes, even where its
        # availability test was deselected (-k); real failures keep pytest's status 1.
        if self.cannot_run and not self._other_failures and session.exitstatus in _REPLACEABLE:
            session.exitstatus = EXIT_BACKEND_CANNOT_RUN
        paths = self.config.getoption("attnhub_report")
        if not paths:
            return
        from attnhub_conformance.report import write_report

        for path in paths:
            write_report(self.matrix, self.targets, path)


_STATE = pytest.StashKey[SuiteState]()


def state_of(config: pytest.Config) -> SuiteState:
    return config.stash[_STATE]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(kind): parametrize 'case' with the attnhub conformance cases of "
        "this kind, generated from each backend's declared capabilities",
    )
    config.addinivalue_line(
        "markers",
        f"{MULTI_RANK_MARKER}: spawns torch.distributed (gloo) process groups (decode context "
        "parallel through the backend); deselect with -m 'not multi_rank'",
    )
    state = config.stash[_STATE] = SuiteState(config)
    config.pluginmanager.register(state, "attnhub-conformance-state")
    seed = config.getoption("attnhub_hypothesis_seed")
    if seed != "random":
        _parse_seed(seed)
    examples = config.getoption("attnhub_hypothesis_examples")
    if examples < 1:  # hypothesis would fail every property test, each with its own traceback
        raise pytest.UsageError(
            f"--attnhub-hypothesis-examples {examples}: use a positive number of examples"
        )
    for path in config.getoption("attnhub_report"):
        if not path.lower().endswith((".json", ".md", ".markdown", ".html", ".htm")):
            raise pytest.UsageError(f"--attnhub-report {path}: use a .json, .md or .html file name")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker(MARKER)
    if marker is None:
        return
    kind = marker.args[0]
    cases = state_of(metafunc.config).cases(kind)
    if not cases:
        metafunc.parametrize(
            "case",
            [
                pytest.param(
                    None, marks=pytest.mark.skip(reason="no backend runs this check"), id="none"
                )
            ],
        )
        return
    metafunc.parametrize("case", cases, ids=[c.id for c in cases])


def _case_of(item: pytest.Item) -> Case | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None or item.get_closest_marker(MARKER) is None:
        return None
    return callspec.params.get("case")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        case = _case_of(item)
        if case is None:
            continue
        t = case.target
        item.user_properties.append(
            (
                PROPERTY,
                {
                    "backend": t.name,
                    "rows": list(case.rows),
                    "status": t.status,
                    "not_supported": case.not_supported,
                    "not_applicable": case.not_applicable,
                    "reason": t.load_error or t.unavailable,
                    # a failure that says "this backend cannot run here", not a wrong result
                    "cannot_run": case.kind == "availability" and t.cannot_run is not None,
                },
            )
        )


def pytest_runtest_setup(item: pytest.Item) -> None:
    case = _case_of(item)
    if case is not None and case.skip is not None:
        pytest.skip(case.skip)


@pytest.fixture
def attnhub_record(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """``attnhub_record("not supported")``: the test proved a refusal rather than a result."""

    def record(label: str) -> None:
        for key, facts in request.node.user_properties:
            if key == PROPERTY:
                facts["not_supported"] = label == "not supported"

    return record


@pytest.fixture
def attnhub_hypothesis_examples(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("attnhub_hypothesis_examples"))


@pytest.fixture
def attnhub_hypothesis_seed(request: pytest.FixtureRequest) -> int:
    """The session's ``--attnhub-hypothesis-seed`` (see ``SuiteState.hypothesis_seed``)."""
    state = state_of(request.config)
    state._seeded.add(request.node.nodeid)
    return state.hypothesis_seed


@pytest.fixture
def attnhub_soak_options(request: pytest.FixtureRequest) -> tuple[int, int, int]:
    """(soak steps, fuzz examples, seed) of this session."""
    get = request.config.getoption
    return get("attnhub_soak_steps"), get("attnhub_fuzz_examples"), get("attnhub_soak_seed")


@pytest.fixture
def attnhub_figures(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """``attnhub_figures(line)``: a line the end of the run prints (the soak's figures)."""
    return state_of(request.config).figures.append


def _parse_seed(text: str) -> int:
    try:
        seed = int(text)
    except ValueError:
        seed = -1
    if seed < 0:
        raise pytest.UsageError(
            f"--attnhub-hypothesis-seed {text}: use a non-negative integer or 'random'"
        )
    return seed


def _short_reason(report: pytest.TestReport) -> str | None:
    """A skip's reason, or the first line of a failure's message."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = getattr(crash, "message", None) or report.longreprtext
        return message.strip().splitlines()[0][:500] if message.strip() else None
    return None
