"""A vendor backend's own host work per call, with its op namespace replaced by no-ops.

``attnhub bench --host`` times the vendor backends inside the emulators' null-kernel mode: every
op still runs its argument checks, and the time inside the ops is subtracted. Those checks
(hundreds of microseconds of Python per forward) evict the backend's working set from the CPU
caches, so the subtracted figure overstates the backend's own lines by an amount that varies
with the machine's load. This script times the same steps (``attnhub.bench.HOST_STEPS``: bf16,
8 query heads / 2 kv heads / head 64, block 128) with **no emulator code at all** in the timed
calls: the backend instance's op namespace (``backend.ops``) is replaced by plain functions that
return what the real op returned, so the figure is comparable with vLLM's wrapper timed with
its own ops as no-ops (``attnhub.bench.vllm_host_overhead``).

How the no-ops are made, per backend and step: one ``forward`` and one ``write_kv(meta=)`` run
through a recording proxy over the real (emulated) namespace, which notes every attribute path
the backend reads and, for each op it calls, what the op returned: one of its own arguments
(``out=``: the same object is returned again, so the backend's code after the call takes the
same branch), or an object of its own (that very tensor is returned again: preallocated). The
namespace is then rebuilt from those paths as plain ``SimpleNamespace`` objects and functions,
so an attribute read in the timed calls costs what it costs on a module. ``build`` runs as is
(as in ``attnhub bench --host``).

Per call: the median over ``--runs`` runs of the mean CPU time of this thread (one torch
thread), as ``attnhub bench --host`` measures.

    python benchmarks/vendor_host.py                       # flash (vllm), iluvatar, ascend
    python benchmarks/vendor_host.py --backend iluvatar --steps "mixed x16"
    python benchmarks/vendor_host.py --compare /path/to/other/tree --rounds 3

``--compare TREE`` runs this script in separate processes, alternating the code of TREE (its
``attnhub`` and ``backends/*`` directories first on ``PYTHONPATH``: an export of another
commit, say) with the code imported by default, ``--rounds`` times, and prints both medians
(the median over the rounds) per backend, step and column, with the load average before and
after. The script itself is always this file: it uses no attnhub API newer than
``attnhub.bench``'s host steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

BACKENDS = ("flash", "iluvatar", "ascend")
PLAIN = (bool, int, float, str, bytes, type(None))


# --- the no-op namespace -----------------------------------------------------------------------


class _Recording:
    """A proxy over one object of a backend's op namespace: attribute reads are noted in
    ``paths`` (and proxied), calls are made for real and their results noted."""

    def __init__(self, target: Any, path: tuple[str, ...], log: dict[tuple[str, ...], Any]):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_log", log)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        path = (*self._path, name)
        if isinstance(value, PLAIN):  # a flag or a name of the namespace: kept as it is
            self._log.setdefault(path, ("value", value))
            return value
        self._log.setdefault(path, ("node", None))
        return _Recording(value, path, self._log)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self._target(*args, **kwargs)
        how = _returned(result, args, kwargs)
        seen = self._log.get(self._path)
        if seen is not None and seen[0] == "call" and seen[1] != how:
            raise RuntimeError(
                f"op {'.'.join(self._path)} returned different kinds of result in one step: "
                f"{seen[1]} and {how}; it cannot be replaced by one no-op"
            )
        self._log[self._path] = ("call", how)
        return result


def _returned(result: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """How to give ``result`` back from the same call's arguments: ("arg", i), ("kwarg", name),
    ("const", object) or ("tuple", [each element so]). Identity, not equality."""
    if isinstance(result, tuple):
        return ("tuple", [_returned(r, args, kwargs) for r in result])
    for i, a in enumerate(args):
        if a is result and result is not None:
            return ("arg", i)
    for name, a in kwargs.items():
        if a is result and result is not None:
            return ("kwarg", name)
    return ("const", result)


def _noop(how: Any) -> Callable[..., Any]:
    """A function that takes anything and returns what the recorded op returned."""
    kind, what = how
    if kind == "const":

        def const(*args: Any, **kwargs: Any) -> Any:
            return what

        return const
    if kind == "kwarg":

        def kwarg(*args: Any, **kwargs: Any) -> Any:
            return kwargs[what]

        return kwarg
    if kind == "arg":

        def arg(*args: Any, **kwargs: Any) -> Any:
            return args[what]

        return arg
    parts = [_noop(h) for h in what]

    def tuple_(*args: Any, **kwargs: Any) -> Any:
        return tuple(p(*args, **kwargs) for p in parts)

    return tuple_


def noop_namespace(log: dict[tuple[str, ...], Any]) -> Any:
    """The recorded paths as plain objects: a called path is a no-op function (attributes read
    under it set on the function), any other a ``SimpleNamespace``."""
    nodes: dict[tuple[str, ...], Any] = {(): SimpleNamespace()}
    for path in sorted(log, key=len):
        kind, what = log[path]
        if kind == "value":
            node = what
        elif kind == "call":
            node = _noop(what)
        else:
            node = SimpleNamespace()
        nodes[path] = node
        setattr(nodes[path[:-1]], path[-1], node)
    return nodes[()]


# --- timing ------------------------------------------------------------------------------------


def time_backend(name: str, step: str, *, runs: int = 9, calls: int = 200) -> dict[str, Any]:
    """us per call: ``build`` as is; ``forward`` and ``write_kv(meta=)`` with the backend's op
    namespace replaced by no-ops (see the module's docstring)."""
    import torch

    from attnhub import BatchMetadata, select_backend
    from attnhub.bench import HOST_SPEC, _host_step, _per_call_us
    from attnhub.spec import AttentionSpec

    torch.set_num_threads(1)
    s = _host_step(step, "cpu")
    spec = AttentionSpec(**HOST_SPEC)  # type: ignore[arg-type]
    be: Any = select_backend(spec, "cpu", prefer=name, emulate=True)  # a vendor backend: .ops
    cache = be.allocate_kv_cache(s.num_blocks)
    batch = BatchMetadata.from_lengths(s.query_lens, s.seq_lens, s.table, spec.block_size, "cpu")
    builder, impl = be.metadata_builder(), be.impl()
    meta = builder.build(batch)
    q, k = s.q, s.k
    build_us = _per_call_us(lambda: builder.build(batch), calls, runs)

    def forward() -> object:
        return impl.forward(q, k, k, cache, meta)

    def write() -> None:
        impl.write_kv(k, k, cache, meta=meta)

    real = be.ops
    log: dict[tuple[str, ...], Any] = {}
    be.ops = _Recording(real, (), log)
    try:
        forward()
        write()
        be.ops = noop_namespace(log)
        fwd_us = _per_call_us(forward, calls, runs)
        kv_us = _per_call_us(write, calls, runs)
    finally:
        be.ops = real
    called = sorted(".".join(p) for p, (kind, _) in log.items() if kind == "call")
    return dict(build=build_us, forward=fwd_us, write_kv=kv_us, ops=called)


def _tree_path(tree: Path) -> str:
    """PYTHONPATH entries that make ``tree``'s core and backends the ones imported."""
    dirs = [tree, *sorted(p for p in (tree / "backends").iterdir() if p.is_dir())]
    return os.pathsep.join(str(d) for d in dirs)


def _run_once(args: argparse.Namespace, tree: Path | None) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if tree is not None:
        env["PYTHONPATH"] = _tree_path(tree) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, __file__, "--json", "--runs", str(args.runs), "--calls", str(args.calls)]
    cmd += ["--flash-provider", args.flash_provider, "--backend", *args.backend]
    cmd += ["--steps", *args.steps]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def _compare(args: argparse.Namespace) -> None:
    other = Path(args.compare).resolve()
    print(f"load average before: {os.getloadavg()}", flush=True)
    results: dict[str, list[dict[str, Any]]] = {"other": [], "this": []}
    for r in range(args.rounds):
        order = [("other", other), ("this", None)]
        if r % 2:
            order.reverse()
        for label, tree in order:
            results[label].append(_run_once(args, tree))
            print(f"round {r + 1}: {label} done, load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"load average after: {os.getloadavg()}")
    print(
        f"other = {other}; this = the code imported by default; medians over {args.rounds} "
        "rounds of each round's median (us per call, CPU time of the thread)"
    )
    print(
        "| backend | step | build other | build this | forward other | forward this | "
        "write_kv other | write_kv this |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for key in results["this"][0]:
        row = [key.split("|")[0], key.split("|")[1]]
        for col in ("build", "forward", "write_kv"):
            for label in ("other", "this"):
                vals = [run[key][col] for run in results[label]]
                row.append(f"{statistics.median(vals):.1f} ({min(vals):.1f}-{max(vals):.1f})")
        print("| " + " | ".join(row) + " |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", nargs="+", default=list(BACKENDS))
    parser.add_argument("--steps", nargs="+", default=None, help="keys of HOST_STEPS")
    parser.add_argument("--flash-provider", default="vllm")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--compare", metavar="TREE", help="alternate with TREE's code")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    # the flash plugin registers the class of this provider (read when attnhub loads plugins)
    os.environ["ATTNHUB_FLASH_PROVIDER"] = args.flash_provider
    from attnhub.bench import HOST_STEPS

    args.steps = args.steps or list(HOST_STEPS)
    if args.compare:
        _compare(args)
        return
    out: dict[str, Any] = {}
    from attnhub.errors import AttnhubError

    for name in args.backend:
        for step in args.steps:
            t0 = time.perf_counter()
            try:
                r = time_backend(name, step, runs=args.runs, calls=args.calls)
            except AttnhubError as exc:  # e.g. provider fa2 refuses block 128: say so, go on
                print(f"{name} {step}: not timed: {exc}", file=sys.stderr, flush=True)
                break
            out[f"{name}|{step}"] = r
            if not args.json:
                print(
                    f"{name:9s} {step:12s} build {r['build']:7.1f}  forward {r['forward']:6.1f}  "
                    f"write_kv {r['write_kv']:5.1f} us  ({time.perf_counter() - t0:.1f} s; "
                    f"no-ops: {', '.join(r['ops'])})",
                    flush=True,
                )
    if args.json:
        json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
