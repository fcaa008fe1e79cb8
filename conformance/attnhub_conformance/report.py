"""The features x backends matrix: filled from test reports, rendered as a rich table, JSON,
Markdown or HTML.

A cell says what the session proved about one feature of one backend (``LEGEND``), with
``passed/run`` counts where the row ran more than one test.
"""

from __future__ import annotations

import html
import io
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnhub_conformance.cases import SHAPE_ORDER
from attnhub_conformance.targets import Target

STATES = (
    "fail",
    "pass",
    "emulated",
    "not supported",
    "not applicable",
    "unavailable",
    "skipped",
    "-",
)
#: What each state of a cell means (the reports print it under the matrix).
LEGEND = {
    "pass": "every test of the row passed (natively)",
    "emulated": "every test of the row passed, through the backend's CPU emulator",
    "fail": "at least one test of the row failed (the failing cases are listed)",
    "not supported": "the backend does not declare the feature and refused it with a reason",
    "not applicable": "the check does not apply to the backend here, e.g. no host sync per layer "
    "for a backend that runs on the CPU only: there is no device to sync (the reason is given)",
    "unavailable": "the backend cannot run on this device (the reason is given)",
    "skipped": "the row's tests were skipped for another reason",
    "-": "nothing of the row ran for this backend (filtered out, or not applicable)",
}
COUNTS = "n/m: n of the row's m tests passed (shown where a row ran more than one)"
STYLES = {
    "pass": "green",
    "emulated": "cyan",
    "fail": "bold red",
    "not supported": "yellow",
    "not applicable": "dim",
    "unavailable": "magenta",
    "skipped": "dim",
    "-": "dim",
}
#: Matrix sections, in order; a row belongs to the first section its name starts with.
SECTIONS = (
    "availability",
    "batch:",
    "cascade",
    "attention:",
    "dtype:",
    "head size:",
    "value head size:",
    "heads:",
    "block size:",
    "feature:",
    "kv cache:",
    "kv cache writes",
    "quantized cache accuracy:",
    "output buffer",
    "long context:",
    "non-contiguous",
    "extreme logits:",
    "lse",
    "mla:",
    "multi-rank:",
    "invalid inputs",
    "determinism",
    "batch invariance",
    "metadata reuse",
    "graph capture",
    "torch.compile",
    "random batches",
    "soak",
    "API fuzz",
)
_ORDER_WITHIN = {
    "batch:": SHAPE_ORDER,
    "attention:": ["decoder", "encoder", "encoder_only", "encoder_decoder"],
    "dtype:": ["bf16", "fp16", "fp32"],
    "heads:": ["mha", "gqa4", "mqa"],
    "feature:": ["sliding_window", "softcap", "alibi", "sinks", "combined"],
    "kv cache:": ["auto", "fp8_e4m3", "fp8_e5m2", "int8", "int8_k"],
    "quantized cache accuracy:": ["fp8_e4m3", "fp8_e5m2", "int8", "int8_k"],
    "long context:": [
        "past the split threshold",
        "decode 32k",
        "chunked prefill 32k",
        "decode 128k",
    ],
    "mla:": [
        "absorbed form",
        "batch shapes",
        "dtypes",
        "block sizes",
        "layouts",
        "fp8 latent",
        "fp8 kv writes",
        "kv writes",
        "lse",
        "invalid inputs",
        "refusals",
    ],
    "extreme logits:": [
        "scores ~1e4",
        "all logits equal",
        "at the softcap limit",
        "very negative ALiBi",
    ],
}


def row_key(row: str) -> tuple[int, int, float, str]:
    section = next((i for i, s in enumerate(SECTIONS) if row.startswith(s)), len(SECTIONS))
    prefix = SECTIONS[section] if section < len(SECTIONS) else ""
    rest = row[len(prefix) :].strip()
    order = _ORDER_WITHIN.get(prefix, [])
    known = order.index(rest) if rest in order else len(order)
    number = float(rest) if re.fullmatch(r"\d+", rest) else 0.0
    return (section, known, number, rest)


@dataclass
class Result:
    """One test's outcome, as far as the matrix cares."""

    backend: str
    rows: list[str]
    status: str  # the backend's: native, emulated, unavailable, failed to load
    outcome: str = "passed"  # passed, failed, skipped
    not_supported: bool = False
    not_applicable: bool = False
    reason: str | None = None


@dataclass
class Cell:
    passed: int = 0
    failed: int = 0
    not_supported: int = 0
    not_applicable: int = 0
    skipped: int = 0
    emulated: bool = False
    unavailable: bool = False
    failures: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    @property
    def state(self) -> str:
        if self.failed:
            return "fail"
        if self.passed:
            return "emulated" if self.emulated else "pass"
        if self.not_supported:
            return "not supported"
        if self.not_applicable:
            return "not applicable"
        if self.unavailable:
            return "unavailable"
        if self.skipped:
            return "skipped"
        return "-"

    @property
    def label(self) -> str:
        """The state, with ``passed/run`` counts where more than one test ran."""
        n = self.passed + self.failed
        return self.state + (f" {self.passed}/{n}" if n > 1 else "")

    def as_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "passed": self.passed,
            "failed": self.failed,
            "not_supported": self.not_supported,
            "not_applicable": self.not_applicable,
            "skipped": self.skipped,
            "failures": self.failures,
            "reasons": sorted(set(self.reasons)),
        }


class Matrix:
    """Results by test id; cells by (row, backend) computed from them."""

    def __init__(self, scope: str, device: str) -> None:
        self.scope, self.device = scope, device
        self.results: dict[str, Result] = {}

    def record(
        self, nodeid: str, when: str, outcome: str, facts: dict[str, Any], reason: str | None
    ) -> None:
        r = self.results.get(nodeid)
        if r is None:
            r = self.results[nodeid] = Result(
                facts["backend"], list(facts["rows"]), facts["status"], reason=facts.get("reason")
            )
        r.not_supported = bool(facts.get("not_supported"))
        r.not_applicable = bool(facts.get("not_applicable"))
        if outcome == "failed":
            r.outcome, r.reason = "failed", reason
        elif outcome == "skipped" and r.outcome != "failed":
            r.outcome, r.reason = "skipped", reason or r.reason

    @property
    def backends(self) -> list[str]:
        return sorted({r.backend for r in self.results.values()})

    @property
    def rows(self) -> list[str]:
        return sorted({row for r in self.results.values() for row in r.rows}, key=row_key)

    def cells(self) -> dict[tuple[str, str], Cell]:
        cells: dict[tuple[str, str], Cell] = {}
        for nodeid, r in self.results.items():
            for row in r.rows:
                c = cells.setdefault((row, r.backend), Cell())
                c.emulated = r.status == "emulated"
                if r.outcome == "failed":
                    c.failed += 1
                    c.failures.append(nodeid)
                elif r.not_supported:
                    c.not_supported += 1
                elif r.not_applicable and r.outcome == "skipped":
                    c.not_applicable += 1
                elif r.outcome == "skipped":
                    c.skipped += 1
                    c.unavailable = r.status in ("unavailable", "failed to load")
                else:
                    c.passed += 1
                if r.reason and r.outcome != "passed":
                    c.reasons.append(r.reason)
        return cells

    def cell(self, cells: dict[tuple[str, str], Cell], row: str, backend: str, status: str) -> Cell:
        """The cell, or what an absent one means for a backend that did not run at all."""
        c = cells.get((row, backend))
        if c is not None:
            return c
        return Cell(unavailable=status in ("unavailable", "failed to load"))

    @property
    def failed(self) -> bool:
        return any(r.outcome == "failed" for r in self.results.values())

    def skip_reasons(self) -> list[tuple[str, str, int]]:
        """(backend, reason, how many tests) of every skip, refusals proved aside, except
        those of backends that did not run at all (their one reason is said apart)."""
        counts: dict[tuple[str, str], int] = {}
        for nodeid, r in self.results.items():
            if r.outcome != "skipped" or r.not_supported:
                continue
            if r.status in ("unavailable", "failed to load"):
                continue
            why = r.reason or "no reason given"
            case = nodeid.rsplit("[", 1)[-1].rstrip("]")  # a reason naming its case: grouped
            key = (r.backend, why.removeprefix(f"{case}: "))
            counts[key] = counts.get(key, 0) + 1
        return [(b, why, n) for (b, why), n in sorted(counts.items())]


def _tolerances(targets: list[Target]) -> list[tuple[str, str, float, float]]:
    """(backend, dtype, atol, rtol) for each loaded backend's declared tolerances."""
    rows = []
    for t in targets:
        if t.backend is None:
            continue
        declared = t.backend.capabilities.tolerances
        for dtype, tol in sorted(declared.items(), key=lambda kv: str(kv[0])):
            rows.append((t.name, str(dtype).removeprefix("torch."), tol.atol, tol.rtol))
    return rows


def _columns(matrix: Matrix, targets: list[Target]) -> list[tuple[str, str]]:
    """(backend, status) for every backend with results, in target order."""
    status = {t.name: t.status for t in targets}
    names = [t.name for t in targets if t.name in matrix.backends]
    names += [b for b in matrix.backends if b not in names]
    return [(n, status.get(n, "native")) for n in names]


def _detail(status: str, target: Target | None) -> str:
    """What a column's header adds to the backend's name: how it ran (unless natively) and
    which provider served the name, where a backend has several (flash)."""
    parts = [] if status == "native" else [status]
    if target is not None and target.provider is not None:
        parts.append(f"provider {target.provider}")
    return ", ".join(parts)


def _headers(matrix: Matrix, targets: list[Target]) -> list[tuple[str, str, str]]:
    """(backend, status, detail) per column (see ``_detail``)."""
    by_name = {t.name: t for t in targets}
    return [(n, s, _detail(s, by_name.get(n))) for n, s in _columns(matrix, targets)]


def as_json(matrix: Matrix, targets: list[Target]) -> dict[str, Any]:
    import attnhub

    cells = matrix.cells()
    cols = _columns(matrix, targets)
    by_name = {t.name: t for t in targets}
    backends = {}
    for name, status in cols:
        t = by_name.get(name)
        caps = tolerances = None
        if t is not None and t.backend is not None:
            caps = t.backend.capabilities.summary()
            tolerances = {
                dtype: {"atol": atol, "rtol": rtol}
                for backend, dtype, atol, rtol in _tolerances([t])
            }
        backends[name] = {
            "status": status,
            "provider": None if t is None else t.provider,
            "reason": None if t is None else (t.load_error or t.unavailable),
            "distribution": None if t is None else t.distribution,
            "version": None if t is None else t.version,
            "capabilities": caps,
            "tolerances": tolerances,
        }
    return {
        "suite": "attnhub-conformance",
        "attnhub_version": attnhub.__version__,
        "scope": matrix.scope,
        "device": matrix.device,
        "states": list(STATES),
        "backends": backends,
        "rows": matrix.rows,
        "matrix": {
            row: {name: matrix.cell(cells, row, name, status).as_dict() for name, status in cols}
            for row in matrix.rows
        },
        "skip_reasons": [
            {"backend": b, "reason": why, "tests": n} for b, why, n in matrix.skip_reasons()
        ],
        "failed": matrix.failed,
    }


def _table(matrix: Matrix, targets: list[Target]):  # type: ignore[no-untyped-def]
    from rich.table import Table
    from rich.text import Text

    cells = matrix.cells()
    cols = _columns(matrix, targets)
    table = Table()
    table.add_column("feature", no_wrap=True)
    for name, _, detail in _headers(matrix, targets):
        # on a terminal narrower than the matrix, cells wrap (print_table: never cut)
        table.add_column(f"{name}\n({detail})" if detail else name, overflow="fold")
    section = None
    for row in matrix.rows:
        this = row_key(row)[0]
        if section is not None and this != section:
            table.add_section()
        section = this
        out = [Text(row)]
        for name, status in cols:
            c = matrix.cell(cells, row, name, status)
            out.append(Text(c.label, style=STYLES[c.state]))
        table.add_row(*out)
    return table


def render_text(
    matrix: Matrix, targets: list[Target], *, width: int = 100, color: bool = False
) -> str:
    """The matrix as a terminal table (with ANSI colours when ``color``)."""
    from rich.console import Console

    buf = io.StringIO()
    console = Console(
        file=buf,
        width=max(width, 60),
        force_terminal=color,
        color_system="standard" if color else None,
        highlight=False,
    )
    print_matrix(matrix, targets, console)
    return buf.getvalue()


def print_matrix(
    matrix: Matrix,
    targets: list[Target],
    console: Any,
    *,
    rerun: str = "pytest --pyargs attnhub_conformance",
    say: Callable[[str], str] = str,
) -> None:
    """The matrix, why backends did not run, and the failing cases, on a rich console.

    ``rerun`` is the command that reruns one case with ``-k``; ``say`` rewrites the reasons
    printed (``attnhub conformance`` names its own options there, not the pytest plugin's).
    """
    from rich.markup import escape

    from attnhub.cli import print_table

    console.print(
        f"[bold]attnhub conformance[/] ({matrix.scope} scope, device {matrix.device})",
        soft_wrap=True,
    )
    print_table(console, _table(matrix, targets))
    for t in targets:
        if t.load_error or t.unavailable:
            why = say(t.load_error or t.unavailable or "")
            console.print(f"[magenta]{t.name}[/]: {t.status}: {escape(why)}", soft_wrap=True)
    skips = matrix.skip_reasons()
    if skips:
        console.print("[dim]skipped[/] (backend: reason, tests):", soft_wrap=True)
        for backend, why, n in skips:
            console.print(f"  {backend}: {escape(say(why))} ({n})", soft_wrap=True)
    failed = [
        (row, name, c)
        for (row, name), c in sorted(matrix.cells().items(), key=lambda kv: row_key(kv[0][0]))
        if c.failed
    ]
    if failed:
        console.print(f"[bold red]failing cases[/] (rerun one: {escape(rerun)} -k '<case>'):")
        seen: set[str] = set()
        for _, _, c in failed:
            for nodeid in c.failures:
                if nodeid not in seen:
                    seen.add(nodeid)
                    console.print(f"  {case_name(nodeid)}", markup=False, soft_wrap=True)


def case_name(nodeid: str) -> str:
    """What ``-k`` selects one case by: ``test_x[params]`` (a node id's path does not match)."""
    return nodeid.rsplit("::", 1)[-1]


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def as_markdown(matrix: Matrix, targets: list[Target]) -> str:
    cells = matrix.cells()
    cols = _columns(matrix, targets)
    lines = [
        f"# attnhub conformance ({matrix.scope} scope, device `{matrix.device}`)",
        "",
        "| feature | "
        + " | ".join(f"{n} ({d})" if d else n for n, _, d in _headers(matrix, targets))
        + " |",
        "|---|" + "---|" * len(cols),
    ]
    for row in matrix.rows:
        states = []
        for name, status in cols:
            c = matrix.cell(cells, row, name, status)
            states.append(f"**{c.label}**" if c.state == "fail" else c.label)
        lines.append(f"| {row} | " + " | ".join(states) + " |")
    notes = [
        f"- `{t.name}`: {t.status}: {t.load_error or t.unavailable}"
        for t in targets
        if t.load_error or t.unavailable
    ]
    failures = sorted({n for c in cells.values() for n in c.failures})
    if notes:
        lines += ["", *notes]
    skips = matrix.skip_reasons()
    if skips:
        lines += ["", "## Skipped", "", "| backend | reason | tests |", "|---|---|---|"]
        lines += [f"| {b} | {_md_cell(why)} | {n} |" for b, why, n in skips]
    lines += ["", "## Legend", "", *(f"- **{s}**: {m}" for s, m in LEGEND.items())]
    lines += [f"- {COUNTS}"]
    tolerances = _tolerances([t for t in targets if t.name in dict(cols)])
    if tolerances:
        lines += [
            "",
            "## Tolerances",
            "",
            "Each backend's declared `|out - ref| <= atol + rtol * |ref|`, per dtype.",
            "",
            "| backend | dtype | atol | rtol |",
            "|---|---|---|---|",
            *(f"| {b} | {d} | {a:g} | {r:g} |" for b, d, a, r in tolerances),
        ]
    if failures:
        lines += ["", "## Failing cases", "", *(f"- `{n}`" for n in failures)]
    return "\n".join(lines) + "\n"


def as_html(matrix: Matrix, targets: list[Target]) -> str:
    colors = {
        "pass": "#c8f7c5",
        "emulated": "#c5e9f7",
        "fail": "#f7c5c5",
        "not supported": "#f7efc5",
        "not applicable": "#f4f4f4",
        "unavailable": "#e9c5f7",
        "skipped": "#eeeeee",
        "-": "#ffffff",
    }
    cells = matrix.cells()
    cols = _columns(matrix, targets)
    esc = html.escape
    head = "".join(
        f"<th>{esc(n)}" + (f"<br><small>{esc(d)}</small>" if d else "") + "</th>"
        for n, _, d in _headers(matrix, targets)
    )
    body = []
    for row in matrix.rows:
        tds = []
        for name, status in cols:
            c = matrix.cell(cells, row, name, status)
            title = esc("\n".join(c.failures or sorted(set(c.reasons))))
            tds.append(
                f'<td style="background:{colors[c.state]}" title="{title}">{esc(c.label)}</td>'
            )
        body.append(f"<tr><th>{esc(row)}</th>{''.join(tds)}</tr>")
    legend = (
        "<h2>Legend</h2><table>"
        + "".join(
            f'<tr><td style="background:{colors[s]}">{esc(s)}</td><td>{esc(m)}</td></tr>'
            for s, m in LEGEND.items()
        )
        + f"</table><p>{esc(COUNTS)}</p>"
    )
    tolerances = _tolerances([t for t in targets if t.name in dict(cols)])
    tol_html = (
        "<h2>Tolerances</h2><p>Each backend's declared <code>|out - ref| &lt;= atol + rtol * "
        "|ref|</code>, per dtype.</p><table><tr><th>backend</th><th>dtype</th><th>atol</th>"
        "<th>rtol</th></tr>"
        + "".join(
            f"<tr><td>{esc(b)}</td><td>{esc(d)}</td><td>{a:g}</td><td>{r:g}</td></tr>"
            for b, d, a, r in tolerances
        )
        + "</table>"
        if tolerances
        else ""
    )
    skips = matrix.skip_reasons()
    skip_html = (
        "<h2>Skipped</h2><table><tr><th>backend</th><th>reason</th><th>tests</th></tr>"
        + "".join(
            f"<tr><td>{esc(b)}</td><td>{esc(why)}</td><td>{n}</td></tr>" for b, why, n in skips
        )
        + "</table>"
        if skips
        else ""
    )
    failures = sorted({n for c in cells.values() for n in c.failures})
    fail_html = (
        "<h2>Failing cases</h2><ul>"
        + "".join(f"<li><code>{esc(n)}</code></li>" for n in failures)
        + "</ul>"
        if failures
        else ""
    )
    title = f"attnhub conformance ({esc(matrix.scope)} scope, device {esc(matrix.device)})"
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{title}</title><style>body{{font-family:sans-serif}}"
        "table{border-collapse:collapse}td,th{border:1px solid #999;padding:2px 8px;"
        "text-align:left}</style></head><body>"
        f"<h1>{title}</h1><table><tr><th>feature</th>{head}</tr>{''.join(body)}</table>"
        f"{skip_html}{legend}{tol_html}{fail_html}</body></html>\n"
    )


def write_report(matrix: Matrix, targets: list[Target], path: str | Path) -> Path:
    """Write the matrix in the format named by ``path``'s suffix (.json, .md, .html)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix == ".json":
        text = json.dumps(as_json(matrix, targets), indent=2) + "\n"
    elif suffix in (".md", ".markdown"):
        text = as_markdown(matrix, targets)
    elif suffix in (".html", ".htm"):
        text = as_html(matrix, targets)
    else:
        raise ValueError(f"report {str(path)!r}: use a .json, .md or .html file name")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text, encoding="utf-8")
    return p
