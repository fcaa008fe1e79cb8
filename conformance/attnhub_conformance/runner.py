"""``attnhub conformance``: run the suite in-process with a progress bar, then print the matrix.

    attnhub conformance [--backend NAME ...] [--emulate/--no-emulate] [--quick|--full]
                        [--report PATH ...] [--device DEV] [--allow-unavailable] [--threads N]

By default every discovered backend runs: natively where it can, through its CPU emulator where
its hardware is absent (``--no-emulate`` reports those as unavailable instead). A backend named
with ``--backend`` that cannot run fails the run (exit status 6 when nothing else failed), as
does a default run in which no backend can run; ``--allow-unavailable`` reports them as
unavailable instead. pytest's own output is kept off the terminal; failures are listed with
their test ids and the first lines of their messages, and the return code is non-zero when
anything failed. Progress goes to stderr: a bar on a terminal, else a line as each case group
(one test function on one backend) starts, with the counts so far and the elapsed time.
Messages name this command's options, not the pytest plugin's (``--report``, not
``--attnhub-report``).

The suite's tensors are small: torch runs them on ``--threads`` intra-op threads, 1 by default.
More threads gain nothing at these sizes and, where another process shares the cores, spinning
OpenMP threads make a run several times slower. Hypothesis keeps its files in a temporary
directory (``HYPOTHESIS_STORAGE_DIRECTORY`` when set), not in the working directory.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import io
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Any

import pytest

from attnhub.cli import positive_count, thread_count, torch_device

PLUGIN = "attnhub_conformance.plugin"
#: plugin.EXIT_BACKEND_CANNOT_RUN, restated: importing the plugin module before pytest loads it
#: would keep pytest from rewriting its asserts.
EXIT_BACKEND_CANNOT_RUN = 6
REPORT_SUFFIXES = (".json", ".md", ".markdown", ".html", ".htm")
#: Intra-op threads unless ``--threads`` says otherwise (see the module's docstring).
DEFAULT_THREADS = 1
#: The pytest plugin's options as this command spells them.
CLI_OPTIONS = {
    "--attnhub-backend": "--backend",
    "--attnhub-emulate": "--emulate",
    "--attnhub-allow-unavailable": "--allow-unavailable",
    "--attnhub-device": "--device",
    "--attnhub-scope": "--quick/--full",
    "--attnhub-report": "--report",
    "--attnhub-hypothesis-examples": "--hypothesis-examples",
    "--attnhub-hypothesis-seed": "--hypothesis-seed",
}


def in_cli_terms(text: str) -> str:
    """``text`` (a reason, an error) with the plugin's option names replaced by this command's
    and the API's emulation hint by the command's: what comes through ``attnhub conformance``
    names the options its user can type."""
    from attnhub.emulation import in_terms_of

    text = in_terms_of(text, "cli")
    return re.sub(r"--attnhub-[a-z-]+", lambda m: CLI_OPTIONS.get(m[0], m[0]), text)


def _report_path(path: str) -> str:
    if not path.lower().endswith(REPORT_SUFFIXES):
        raise argparse.ArgumentTypeError(f"{path}: use a .json, .md or .html file name")
    return path


#: ``--hypothesis-examples``' argument.
_example_count = positive_count("examples")


def _seed(text: str) -> str:
    """``--hypothesis-seed``' argument: a non-negative integer or 'random'."""
    if text != "random" and not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"{text}: use a non-negative integer or 'random'")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="attnhub conformance",
        description="Run the attnhub conformance suite against backends and print the "
        "features x backends matrix.",
        epilog="Exit status: 0 everything that ran passed; 1 a test failed; 2 or 4 usage error "
        "(e.g. a bad option value, an unknown backend); 5 no case was selected (-k matched "
        f"none); {EXIT_BACKEND_CANNOT_RUN} nothing failed, but a backend the run "
        "had to test cannot run here (named with --backend and unavailable, no backend of a "
        "default run can run, or a plugin failed to load).",
    )
    p.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="NAME",
        help="backend to test (repeatable; default: every discovered backend)",
    )
    p.add_argument(
        "--emulate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run vendor backends through their CPU emulators where the hardware "
        "is absent (default: on)",
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "--quick",
        dest="scope",
        action="store_const",
        const="quick",
        help="every declared feature and batch shape, few combinations (default)",
    )
    scope.add_argument(
        "--full", dest="scope", action="store_const", const="full", help="the wider matrix"
    )
    p.set_defaults(scope="quick")
    p.add_argument(
        "--report",
        action="append",
        default=[],
        type=_report_path,
        metavar="PATH",
        help="also write the matrix to PATH (.json, .md or .html; repeatable)",
    )
    p.add_argument(
        "--device", default="cpu", type=torch_device, help="device to run on (default: cpu)"
    )
    p.add_argument(
        "--allow-unavailable",
        action="store_true",
        help="report a backend named with --backend that cannot run on the device as "
        "unavailable instead of failing the run (likewise a default run where none can run)",
    )
    p.add_argument(
        "--hypothesis-examples",
        type=_example_count,
        default=None,
        metavar="N",
        help="examples per backend of the random-batch property test",
    )
    p.add_argument(
        "--hypothesis-seed",
        type=_seed,
        default=None,
        metavar="N|random",
        help="seed of the property test's examples (default 0: every run draws the same; "
        "'random': a fresh seed, named at the end of the run)",
    )
    p.add_argument(
        "-k",
        dest="keyword",
        metavar="EXPR",
        help="only run tests matching the pytest -k expression",
    )
    p.add_argument(
        "--threads",
        type=thread_count,
        default=DEFAULT_THREADS,
        metavar="N",
        help=f"torch intra-op threads (default: {DEFAULT_THREADS}: the suite's tensors are small, "
        "and more threads only slow a run down where other processes share the cores)",
    )
    p.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failure")
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show pytest's own report too (full failure tracebacks)",
    )
    return p


def pytest_args(ns: argparse.Namespace) -> list[str]:
    args = ["-q", "-p", "no:cacheprovider"]
    if not _plugin_autoloads():
        args += ["-p", PLUGIN]
    args += [
        "--pyargs",
        "attnhub_conformance",
        "--attnhub-scope",
        ns.scope,
        "--attnhub-device",
        ns.device,
    ]
    for name in ns.backend:
        args += ["--attnhub-backend", name]
    if ns.emulate:
        args.append("--attnhub-emulate")
    if ns.allow_unavailable:
        args.append("--attnhub-allow-unavailable")
    for path in ns.report:
        args += ["--attnhub-report", path]
    if ns.hypothesis_examples is not None:
        args += ["--attnhub-hypothesis-examples", str(ns.hypothesis_examples)]
    if ns.hypothesis_seed is not None:
        args += ["--attnhub-hypothesis-seed", ns.hypothesis_seed]
    if ns.keyword:
        args += ["-k", ns.keyword]
    if ns.exitfirst:
        args.append("-x")
    return args


def _plugin_autoloads() -> bool:
    """True when pytest will load the suite's plugin through its ``pytest11`` entry point."""
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return False
    return any(ep.value == PLUGIN for ep in md.entry_points(group="pytest11"))


class Progress:
    """A pytest plugin that shows progress and keeps what the runner prints after.

    On a terminal, a rich bar, redrawn from pytest hooks only (never from a thread), at moments
    when pytest is not capturing output; elsewhere (CI logs, pipes) one line when the tests are
    collected, one as each case group starts (a test function on one backend: how many tests it
    holds, the counts so far, the elapsed time) and one when the run ends. pytest's terminal
    reporter writes into a buffer instead of the terminal unless ``verbose``.
    """

    def __init__(self, console: Any, verbose: bool) -> None:
        self.console = console
        self.verbose = verbose
        self.buffer = io.StringIO()
        self.progress: Any = None
        self.task: Any = None
        self.lines = False  # one line per test module instead of a bar
        self.total = self.done = 0
        self.group: tuple[str, str] | None = None  # (module::function, backend) now running
        self.groups: dict[str, tuple[str, str]] = {}  # node id -> its case group
        self.group_sizes: dict[tuple[str, str], int] = {}
        self.started = time.monotonic()
        self.counts = {"passed": 0, "failed": 0, "skipped": 0}
        self.failures: list[tuple[str, str]] = []
        self.state: Any = None  # the suite plugin's SuiteState (targets and matrix)

    @pytest.hookimpl(trylast=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        from attnhub_conformance.plugin import state_of

        self.state = state_of(config)
        if self.verbose:
            return
        reporter = config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)
            config.pluginmanager.register(
                pytest.TerminalReporter(config, self.buffer), "terminalreporter"
            )

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        if self.verbose:
            return
        self.total = len(session.items)
        if not self.console.is_terminal:
            self.lines = True
            for item in session.items:
                group = _case_group(item)
                self.groups[item.nodeid] = group
                self.group_sizes[group] = self.group_sizes.get(group, 0) + 1
            targets = ", ".join(f"{t.name} ({t.status})" for t in self.state.targets)
            self._line(f"{self.total} tests; backends: {targets or 'none'}")
            return
        self.progress = RichProgress(
            TextColumn("[bold]conformance"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[counts]}"),
            TimeElapsedColumn(),
            TextColumn("[dim]{task.fields[current]}"),
            console=self.console,
            auto_refresh=False,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self.task = self.progress.add_task("tests", total=len(session.items), counts="", current="")
        self.progress.start()

    def _line(self, text: str) -> None:
        elapsed = time.monotonic() - self.started
        self.console.print(
            f"conformance [{self.done}/{self.total}] {text} ({elapsed:.0f} s)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )

    def _so_far(self) -> str:
        c = self.counts
        return f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        group = self.groups.get(nodeid)
        if self.lines and group is not None and group != self.group:
            self.group = group
            function, backend = group
            n = self.group_sizes[group]
            on = f" on {backend}" if backend else ""
            tests = "test" if n == 1 else "tests"
            self._line(f"{function}{on}: {n} {tests}; so far {self._so_far()}")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.failures.append((report.nodeid, report.longreprtext))
        done = report.when == "teardown"
        self.done += done
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self.counts[report.outcome] += 1
        if self.progress is None:
            return
        name = report.nodeid.rsplit("::", 1)[-1]
        counts = (
            f"[green]{self.counts['passed']} passed[/] "
            f"[red]{self.counts['failed']} failed[/] "
            f"[yellow]{self.counts['skipped']} skipped[/]"
        )
        self.progress.update(self.task, advance=1 if done else 0, counts=counts, current=name[:60])
        self.progress.refresh()

    def pytest_sessionfinish(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if self.lines:
            self._line(f"done: {self._so_far()}")


def _case_group(item: pytest.Item) -> tuple[str, str]:
    """(``module.py::test_function``, backend) of a collected test: its progress group."""
    from attnhub_conformance.plugin import PROPERTY

    module = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    function = getattr(item, "originalname", None) or item.name
    facts = next((f for key, f in item.user_properties if key == PROPERTY), None)
    backend = facts.get("backend", "") if isinstance(facts, dict) else ""
    return f"{module}::{function}", str(backend)


def _first_lines(text: str, n: int = 6) -> str:
    """The assertion message of a failure (pytest's E lines), else its last lines."""
    lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    lines = lines or text.strip().splitlines()[-n:]
    return "\n".join(lines[:n])


def main(argv: list[str] | None = None) -> int:
    """Run the suite; print the matrix; return 0 only when nothing failed."""
    from rich.console import Console
    from rich.markup import escape

    ns = build_parser().parse_args(argv)
    console = Console(stderr=True, highlight=False)
    out = Console(highlight=False, soft_wrap=not console.is_terminal)
    plugin = Progress(console, ns.verbose)
    code = _run_pytest(ns, plugin)
    state = plugin.state
    if state is not None and state.has_results:
        from attnhub_conformance.report import print_matrix

        if plugin.failures and not ns.verbose:
            out.print(f"[bold red]{len(plugin.failures)} failed:[/]")
            for nodeid, text in plugin.failures:
                out.print(f"[red]FAILED[/] {escape(nodeid)}", soft_wrap=True)
                out.print(in_cli_terms(_first_lines(text)), markup=False, soft_wrap=True)
        print_matrix(
            state.matrix, state.targets, out, rerun="attnhub conformance", say=in_cli_terms
        )
        c = plugin.counts
        out.print(f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped")
        for path in ns.report:
            out.print(f"matrix written to {path}")
    elif code == pytest.ExitCode.NO_TESTS_COLLECTED and ns.keyword and not ns.verbose:
        console.print(f"no conformance case matches -k {ns.keyword!r}", markup=False)
    elif code not in (pytest.ExitCode.OK, EXIT_BACKEND_CANNOT_RUN) and not ns.verbose:
        # Nothing ran (a usage error, an internal error, nothing collected): show pytest's words.
        console.print(in_cli_terms(plugin.buffer.getvalue()), markup=False, highlight=False)
    if state is not None:  # backends whose availability test did not run (-k) to say why
        for target in state.unsaid_cannot_run:
            out.print(
                f"[bold red]not tested:[/] {escape(in_cli_terms(str(target.cannot_run)))}",
                soft_wrap=True,
            )
    return int(code)


def _run_pytest(ns: argparse.Namespace, plugin: Progress) -> int | pytest.ExitCode:
    """pytest.main on ``ns.threads`` intra-op threads, hypothesis's files in a temporary
    directory (unless HYPOTHESIS_STORAGE_DIRECTORY names one); both restored after. Where
    torch is not imported yet, OMP_NUM_THREADS (unless set) sizes its thread pools from the
    start, as a run under ``OMP_NUM_THREADS=N`` would."""
    own_omp = "torch" not in sys.modules and "OMP_NUM_THREADS" not in os.environ
    if own_omp:
        os.environ["OMP_NUM_THREADS"] = str(ns.threads)
    import torch

    threads = torch.get_num_threads()
    own_storage = "HYPOTHESIS_STORAGE_DIRECTORY" not in os.environ
    if own_storage:
        os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = tempfile.mkdtemp(prefix="attnhub-hypothesis-")
    torch.set_num_threads(ns.threads)
    try:
        return pytest.main(pytest_args(ns), plugins=[plugin])
    finally:
        torch.set_num_threads(threads)
        if own_omp:
            os.environ.pop("OMP_NUM_THREADS", None)
        if own_storage:
            shutil.rmtree(os.environ.pop("HYPOTHESIS_STORAGE_DIRECTORY"), ignore_errors=True)


if __name__ == "__main__":  # python -m attnhub_conformance.runner
    raise SystemExit(main())
