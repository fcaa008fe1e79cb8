"""Host overhead of two code trees, alternating: ``attnhub bench --host`` in separate processes.

    python benchmarks/compare_host.py TREE [--rounds 3] [-- ARGS for attnhub bench --host]
    python benchmarks/compare_host.py /tmp/main-export --rounds 5 -- --backend flash

On a shared machine a before/after comparison is only fair when the two versions take turns:
each round runs ``attnhub bench --host --threads 1 --json`` once with TREE's code (its root and
``backends/*`` directories first on ``PYTHONPATH``: an export of another commit, say) and once
with the code imported by default, the order alternating per round, and prints per backend,
step and column the median over the rounds of each run's figure (us per call, CPU time of the
thread; min-max in brackets), with the load average before and after.

Columns: ``build`` (full step checks, and structural checks only where the tree times it); the
forward wrapper and ``write_kv(meta=)``, with a vendor backend's ops as
no-ops where the tree's bench times that (``forward_noop_us``), else its null-kernel figure,
marked ``(null)``: a tree older than that column gives only the latter, which does not compare
with the former.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

COLUMNS = (
    ("build", "build_us"),
    ("build Python checks", "build_python_us"),
    ("build structural", "build_structural_us"),
    ("forward", "forward_us"),
    ("write_kv", "write_kv_us"),
)


def tree_path(tree: Path) -> str:
    """PYTHONPATH entries that make ``tree``'s core and backends the ones imported."""
    dirs = [tree, *sorted(p for p in (tree / "backends").iterdir() if p.is_dir())]
    return os.pathsep.join(str(d) for d in dirs)


def run_once(tree: Path | None, bench_args: list[str]) -> list[dict[str, Any]]:
    """One ``attnhub bench --host`` run in its own process; its host rows."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if tree is not None:
        env["PYTHONPATH"] = tree_path(tree) + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "host.json")
        code = "import sys; from attnhub.cli import main; sys.exit(main(sys.argv[1:]))"
        cmd = [sys.executable, "-c", code, "bench", "--host", "--threads", "1", "--json", out]
        # run outside any source tree: ``python -c`` puts its working directory first on
        # sys.path, which would shadow TREE's code with the checkout it was started from
        subprocess.run([*cmd, *bench_args], env=env, check=True, stdout=subprocess.DEVNULL, cwd=tmp)
        with open(out) as fh:
            rows: list[dict[str, Any]] = json.load(fh)["results"]
    return rows


def figure(row: dict[str, Any], field: str) -> tuple[float, bool]:
    """A column's value and whether it is the null-kernel figure standing in for the no-op one."""
    noop = row.get(field.replace("_us", "_noop_us"))
    if noop is not None:
        return float(noop), False
    null = not field.startswith("build") and row["backend"].endswith("(emulated)")
    return float(row[field]), null


def compare(tree: Path, rounds: int, bench_args: list[str]) -> str:
    """The markdown table of medians (see the module's docstring)."""
    runs: dict[str, list[list[dict[str, Any]]]] = {"other": [], "this": []}
    print(f"load average before: {os.getloadavg()}", flush=True)
    for r in range(rounds):
        order: list[tuple[str, Path | None]] = [("other", tree), ("this", None)]
        for label, where in order if r % 2 == 0 else order[::-1]:
            runs[label].append(run_once(where, bench_args))
            print(f"round {r + 1}: {label} done, load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"load average after: {os.getloadavg()}")
    head = ["backend", "step"] + [f"{c} {label}" for c, _ in COLUMNS for label in ("other", "this")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = [(row["backend"], row["step"]) for row in runs["this"][0]]
    for backend, step in keys:
        cells = [backend, step]
        for _, field in COLUMNS:
            for label in ("other", "this"):
                got = [
                    figure(row, field)
                    for run in runs[label]
                    for row in run
                    if (row["backend"], row["step"]) == (backend, step)
                    and row.get(field) is not None  # a column an older tree lacks
                ]
                if not got:
                    cells.append("-")
                    continue
                vals = [v for v, _ in got]
                mark = " (null)" if any(null for _, null in got) else ""
                cells.append(
                    f"{statistics.median(vals):.1f} ({min(vals):.1f}-{max(vals):.1f}){mark}"
                )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    # everything after "--" goes to attnhub bench --host as it is (argparse would take it for
    # this script's own options)
    cut = argv.index("--") if "--" in argv else len(argv)
    own, bench_args = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        usage="%(prog)s TREE [--rounds N] [-- ARGS for attnhub bench --host]",
    )
    parser.add_argument("tree", type=Path, help="the other code tree (an export of a commit)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(own)
    print(f"other = {args.tree.resolve()}; this = the code imported by default")
    print(compare(args.tree.resolve(), args.rounds, bench_args))


if __name__ == "__main__":
    main()
