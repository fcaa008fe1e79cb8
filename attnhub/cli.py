"""The ``attnhub`` command: list, select, bench, and the commands other distributions add.

A distribution adds a command through an entry point in group ``attnhub.cli`` (as pytest plugins
extend pytest through ``pytest11``); the conformance suite adds ``attnhub conformance`` this way::

    [project.entry-points."attnhub.cli"]
    mycommand = "my_package.cli:command"

The entry point's name is the command's name; its value is a callable with no arguments that
returns ``(help, main)``: a one-line help for ``attnhub --help`` and ``main(argv: list[str]) ->
int``, which parses the arguments after the command name itself (``prog="attnhub mycommand"``) and
returns the exit status. Entry points are loaded only for ``attnhub --help`` and for their own
command, so a plugin that fails to load is reported (one line: its name and its error) and never
breaks the built-in commands.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata as md
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from attnhub.errors import AttnhubError, NoBackendError
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
    try:
        chosen = registry.select(spec, args.device, prefer=args.prefer, emulate=args.emulate)
    except AttnhubError as exc:
        console.print(f"[red]no backend:[/red] {exc}")
        chosen = None
    if chosen is not None:
        mode = " (emulated)" if chosen.emulated else ""
        console.print(f"selected: [bold]{chosen.name}[/bold]{mode} on {args.device}")
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
    for info in list_backends():
        if info.error is not None:
            table.add_row(info.name, f"plugin failed to load: {info.error}")
    console.print(table)
    return 0 if chosen is not None else 2


# --- commands from other distributions (entry-point group attnhub.cli) --------------------
COMMAND_GROUP = "attnhub.cli"
BUILTIN_COMMANDS = ("list", "select", "bench")


@dataclass(frozen=True)
class PluginCommand:
    """One command an installed distribution adds, or why it could not be loaded."""

    name: str
    source: str  # "distribution version", or the entry point's value when it has none
    help: str = ""
    main: Callable[[list[str]], int | None] | None = None
    error: str | None = None  # set when the entry point failed to load or broke the contract


def plugin_commands(only: str | None = None) -> dict[str, PluginCommand]:
    """The commands of entry-point group ``attnhub.cli`` by name, loaded (all, or ``only``)."""
    found: dict[str, PluginCommand] = {}
    for ep in sorted(md.entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        if only is not None and ep.name != only:
            continue
        dist = getattr(ep, "dist", None)
        source = f"{dist.name} {dist.version}" if dist is not None else ep.value
        if ep.name in found:
            if found[ep.name].source != source:  # the same distribution seen twice is no clash
                found[ep.name] = PluginCommand(
                    ep.name, source, error=f"also provided by {found[ep.name].source}"
                )
            continue
        if ep.name in BUILTIN_COMMANDS:
            found[ep.name] = PluginCommand(ep.name, source, error="a built-in command's name")
            continue
        found[ep.name] = _load_command(ep, source)
    return found


def _load_command(ep: md.EntryPoint, source: str) -> PluginCommand:
    try:
        made = ep.load()()
        if not (
            isinstance(made, tuple)
            and len(made) == 2
            and isinstance(made[0], str)
            and callable(made[1])
        ):
            raise TypeError(f"returned {made!r}, expected (help: str, main: callable)")
        help_text, main = made
    except Exception as exc:  # a broken plugin is reported, never a crash of the others
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        error = f"{ep.value}: {type(exc).__name__}" + (f": {first}" if first else "")
        return PluginCommand(ep.name, source, error=error)
    return PluginCommand(ep.name, source, help=help_text, main=main)


def _run_plugin(command: PluginCommand, argv: list[str]) -> int:
    if command.main is None:
        _error(f"command {command.name!r} ({command.source}) failed to load: {command.error}")
        return 2
    code = command.main(argv)
    return 0 if code is None else int(code)


def _unknown_command(name: str, plugins: dict[str, PluginCommand]) -> int:
    known = [*BUILTIN_COMMANDS, *sorted(plugins)]
    close = difflib.get_close_matches(name, known, n=1)
    _error(
        f"unknown command {name!r} (known: {', '.join(known)})"
        + (f"; did you mean {close[0]!r}?" if close else "")
    )
    _error(
        f"other commands come from distributions installed beside attnhub (entry-point group "
        f"{COMMAND_GROUP!r}); the 'Command line' section of attnhub's README says which"
    )
    return 2


def _error(message: str) -> None:
    print(f"attnhub: {message}", file=sys.stderr)


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
def build_parser(plugins: dict[str, PluginCommand] | None = None) -> argparse.ArgumentParser:
    """The built-in commands' parser; ``plugins`` are listed too (their own ``main`` parses
    their arguments)."""
    parser = argparse.ArgumentParser(
        prog="attnhub",
        description="Vendor-neutral paged attention: backends, selection, "
        "conformance and benchmarks.",
        epilog=f"Installed distributions add commands through the {COMMAND_GROUP!r} "
        "entry-point group (the conformance suite adds 'conformance').",
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

    ignored = []
    for command in (plugins or {}).values():
        if command.name in BUILTIN_COMMANDS:
            ignored.append(f"{command.name!r} from {command.source} ({command.error})")
            continue
        help_text = command.help if command.error is None else f"failed to load: {command.error}"
        sub.add_parser(command.name, help=f"{help_text} [{command.source}]", add_help=False)
    if ignored:
        parser.epilog = f"{parser.epilog} Ignored: {'; '.join(ignored)}."
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv[0] if argv else None
    if name is not None and not name.startswith("-") and name not in BUILTIN_COMMANDS:
        plugins = plugin_commands(only=name)
        if name not in plugins:
            return _unknown_command(name, plugin_commands())
        return _run_plugin(plugins[name], argv[1:])
    # built-in commands load no plugin command; `attnhub` / `attnhub --help` lists them all
    args = build_parser(None if name in BUILTIN_COMMANDS else plugin_commands()).parse_args(argv)
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
