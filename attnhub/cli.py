"""The ``attnhub`` command: list, select, conformance, bench."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from attnhub.errors import AttnhubError, NoBackendError, PluginLoadError, PluginLoadWarning
from attnhub.registry import default_registry, list_backends
from attnhub.spec import AttentionSpec

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _console() -> Console:
    return Console(highlight=False)


# --- attnhub list ----------------------------------------------------------------------------
def cmd_list(args: argparse.Namespace) -> int:
    console = _console()
    infos = list_backends()
    rows = []
    for info in infos:
        caps = info.capabilities
        devices = list(args.device or [])
        if caps is not None and caps.devices is not None:
            devices += [d for d in sorted(caps.devices) if d not in devices]
        if not devices:
            devices = ["cpu"]
        availability = {}
        for dev in devices:
            native = info.availability(dev, emulate=False)
            if native is None:
                availability[dev] = "native"
            elif info.backend is not None and info.availability(dev, emulate=True) is None:
                availability[dev] = "emulated"
            else:
                availability[dev] = f"no: {native}"
        rows.append((info, availability))
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "name": info.name,
                        "plugin": info.plugin,
                        "distribution": info.distribution,
                        "version": info.version,
                        "error": info.error,
                        "availability": availability,
                        "capabilities": (
                            None if info.capabilities is None else info.capabilities.summary()
                        ),
                    }
                    for info, availability in rows
                ],
                indent=2,
            )
        )
        return 0
    table = Table(title="attnhub backends")
    for col in ("backend", "distribution", "available", "capabilities"):
        table.add_column(col, overflow="fold")
    for info, availability in rows:
        dist = f"{info.distribution or '-'} {info.version or ''}".strip()
        if info.error is not None:
            table.add_row(info.name, dist, "[red]plugin failed to load[/red]", info.error)
            continue
        assert info.capabilities is not None
        s = info.capabilities.summary()
        caps_text = "\n".join(
            f"{k}: {', '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in s.items()
            if k
            in (
                "dtypes",
                "head_sizes",
                "block_sizes",
                "kv_cache_dtypes",
                "attn_types",
                "features",
                "graph_capture",
            )
        )
        avail = "\n".join(f"{d}: {a}" for d, a in availability.items())
        table.add_row(info.name, dist, avail, caps_text)
    console.print(table)
    return 0


# --- attnhub select --------------------------------------------------------------------------
def _spec_from_args(args: argparse.Namespace) -> AttentionSpec:
    return AttentionSpec(
        num_heads=args.heads,
        num_kv_heads=args.kv_heads or args.heads,
        head_size=args.head_size,
        dtype=DTYPES[args.dtype],
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        attn_type=args.attn_type,
        sliding_window=args.sliding_window,
        logits_soft_cap=args.softcap,
        use_alibi=args.alibi,
        use_sinks=args.sinks,
    )


def cmd_select(args: argparse.Namespace) -> int:
    console = _console()
    spec = _spec_from_args(args)
    registry = default_registry()
    failed = [info for info in list_backends() if info.error is not None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginLoadWarning)  # said once below, errors in the table
        try:
            chosen = registry.select(spec, args.device, prefer=args.prefer, emulate=args.emulate)
        except PluginLoadError as exc:  # its error is the plugin's row of the table
            console.print(f"[red]no backend:[/red] plugin {exc.plugin!r} failed to load")
            chosen = None
        except NoBackendError as exc:  # each candidate's reasons are its row of the table
            console.print(f"[red]no backend:[/red] {exc.message}")
            chosen = None
        except AttnhubError as exc:
            console.print(f"[red]no backend:[/red] {exc}")
            chosen = None
    if chosen is not None:
        mode = " (emulated)" if chosen.emulated else ""
        console.print(f"selected: [bold]{chosen.name}[/bold]{mode} on {args.device}")
    if failed:
        plugins = "plugin" if len(failed) == 1 else "plugins"
        names = ", ".join(repr(info.plugin) for info in failed)
        console.print(
            f"[yellow]warning:[/yellow] {plugins} failed to load, not considered: {names} "
            "(errors in the table)"
        )
    table = Table(title="candidates, in selection order")
    table.add_column("backend")
    table.add_column("verdict", overflow="fold")
    for cls, reasons in registry.rank(spec, args.device, emulate=args.emulate):
        if chosen is not None and cls.name == chosen.name:
            verdict = "[green]selected[/green]"
        elif reasons:
            verdict = "; ".join(reasons)
        elif chosen is None:
            verdict = "usable (not chosen: another backend was asked for)"
        else:
            verdict = "usable, lower priority"
        table.add_row(cls.name, verdict)
    for info in failed:
        table.add_row(info.name, f"[red]plugin failed to load:[/red] {info.error}")
    console.print(table)
    return 0 if chosen is not None else 2


# --- attnhub conformance ---------------------------------------------------------------------
def cmd_conformance(argv: Sequence[str]) -> int:
    try:
        from attnhub_conformance.runner import main as run_suite
    except ImportError:
        _console().print(
            "[red]the conformance suite is not installed:[/red] "
            "pip install -e conformance  (in the attnhub repo) or pip install attnhub-conformance"
        )
        return 2
    return int(run_suite(list(argv)))


# --- attnhub bench ---------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    from attnhub import bench

    console = _console()
    torch.set_num_threads(args.threads or torch.get_num_threads())
    if args.host:
        return _bench_host(args, console)
    cases = bench.default_cases(quick=args.quick)
    results = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("benchmarking", total=len(cases))
        for case in cases:
            progress.update(task, description=f"{case.name} {case.dtype}")
            results.append(
                bench.run_case(
                    case,
                    backend=args.backend,
                    device=args.device,
                    repeats=args.repeats,
                    emulate=args.emulate,
                )
            )
            progress.advance(task)
    where = bench.machine()
    table = Table(title=f"attnhub bench on {args.device}")
    for col in (
        "case",
        "dtype",
        "backend",
        "backend ms",
        "dense SDPA ms",
        "ratio",
        "target",
        "build us",
    ):
        table.add_column(col, justify="right" if col != "case" else "left")
    for r in results:
        ok = r.meets_target
        mark = "" if ok is None else (" [green]ok[/green]" if ok else " [red]missed[/red]")
        table.add_row(
            r.case,
            r.dtype,
            r.backend,
            f"{r.backend_ms:.1f}",
            f"{r.dense_ms:.1f}",
            f"{r.ratio:.2f}x",
            ("-" if r.target is None else f"<= {r.target:.2f}x") + mark,
            f"{r.build_us:.0f}",
        )
    console.print(table)
    console.print(f"machine: {where.describe()}", soft_wrap=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(bench.report(results, where), fh, indent=2)
        console.print(f"wrote {args.json}")
    if args.plot:
        bench.plot(results, args.plot, where)
        console.print(f"wrote {args.plot}")
    return 0


def _bench_host(args: argparse.Namespace, console: Console) -> int:
    from attnhub import bench

    rows = [
        bench.host_overhead(n, backend=args.backend, device=args.device, emulate=args.emulate)
        for n in (1, 32, 256)
    ]
    where = bench.machine()
    table = Table(title="host overhead per call (bf16, 8/2 heads, head 32, block 128, decode)")
    for col in ("backend", "requests", "build us", "forward us", "write_kv(meta=) us"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r.backend,
            str(r.num_reqs),
            f"{r.build_us:.0f}",
            f"{r.forward_us:.0f}",
            f"{r.write_kv_us:.0f}",
        )
    console.print(table)
    console.print(f"machine: {where.describe()}", soft_wrap=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(bench.report(rows, where), fh, indent=2)
    return 0


# --- entry point -----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnhub",
        description="Vendor-neutral paged attention: backends, selection, "
        "conformance and benchmarks.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="every discovered backend, its availability and capabilities")
    p.add_argument("--device", action="append", help="also report availability on this device")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("select", help="which backend a spec gets on a device, and why")
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-size", type=int, required=True)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--attn-type", default="decoder")
    p.add_argument("--sliding-window", type=int, default=None)
    p.add_argument("--softcap", type=float, default=None)
    p.add_argument("--alibi", action="store_true")
    p.add_argument("--sinks", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--emulate", action="store_true")
    p.add_argument("--prefer", default=None, help="name one backend (as ATTNHUB_BACKEND does)")
    p.set_defaults(func=cmd_select)

    sub.add_parser(
        "conformance",
        help="run the conformance suite (options: attnhub conformance --help)",
        add_help=False,
    )

    p = sub.add_parser("bench", help="backend vs dense SDPA, as ratios measured in one run")
    p.add_argument("--backend", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--emulate", action="store_true")
    p.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    p.add_argument(
        "--host", action="store_true", help="host overhead of build / forward / write_kv instead"
    )
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write results to this JSON file")
    p.add_argument("--plot", default=None, help="write a PNG bar chart (needs matplotlib)")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "conformance":
        return cmd_conformance(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except NoBackendError as exc:
        _console().print(f"[red]{exc}[/red]")
        return 2
    except AttnhubError as exc:
        _console().print(f"[red]error:[/red] {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
