"""The plugin surface: four hooks, one discovery. A plugin is a module with

    import attnhub

    @attnhub.hookimpl
    def attnhub_backends():
        return [MyBackend]

registered under the entry-point group ``attnhub`` in its pyproject.toml:

    [project.entry-points.attnhub]
    mybackend = "my_package.plugin"

A plugin implements any of the hooks below (at least one):

- ``attnhub_backends()``: ``AttentionBackend`` subclasses, each with a unique string ``name``
  and its ``Capabilities`` (the runtime's hook: ``select_backend`` ranks them);
- ``attnhub_commands()``: :class:`Command` objects, each an ``attnhub NAME`` subcommand (the
  conformance suite adds ``attnhub conformance`` this way);
- ``attnhub_bench_comparisons()``: :class:`BenchComparison` objects, each a direct kernel
  comparison ``attnhub bench`` runs (a backend's ``forward`` against its vendor's kernels
  called directly);
- ``attnhub_host_comparisons()``: :class:`HostComparison` objects, each another engine's own
  attention timed on ``attnhub bench --host``'s steps (the vLLM integration times vLLM's CPU
  backend this way).

Hooks run once, at discovery (``attnhub.registry``), never per attention call; what the tool
hooks return is light (names and functions): a command's or a comparison's heavy imports happen
when it runs, never at discovery, so an engine that only selects a backend imports no tooling.
A plugin whose module fails to import, whose hook raises or returns something else than the
list described, that implements none of these hooks, or has an ``@attnhub.hookimpl`` under
another name (a misspelling such as ``attnhub_backend``), is listed as failed with that error
(``attnhub list``, ``attnhub --help``) and never breaks the others. The built-in backend loads
first, so a plugin module may use it at import: ``Base = attnhub.get_backend("torch")``.

The entry-point groups ``attnhub.cli`` and ``attnhub.bench`` of attnhub 0.1's first releases
still load (deprecated: use the hooks); see ``attnhub.registry.LEGACY_GROUPS``.

This module imports neither torch nor any other heavy module: ``attnhub --help`` reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from attnhub.backend import AttentionBackend

PROJECT = "attnhub"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class Command:
    """An ``attnhub NAME`` subcommand: ``help`` is its one line in ``attnhub --help``;
    ``main(argv)`` parses the arguments after the command's name itself (``prog="attnhub
    NAME"``) and returns the exit status (None: 0). Import what the command needs inside
    ``main``, not at the plugin module's top."""

    name: str
    help: str
    main: Callable[[list[str]], int | None]


@dataclass(frozen=True)
class BenchComparison:
    """A direct kernel comparison for ``attnhub bench``: ``run(quick=..., repeats=...)``
    returns a list of ``attnhub.bench.DirectComparison`` rows, or raises
    ``attnhub.errors.BenchUnavailableError(reason)`` where it cannot run here (its vendor
    library absent, ...). ``name``: the backend's, by convention."""

    name: str
    run: Callable[..., list[Any]]


@dataclass(frozen=True)
class HostComparison:
    """Another engine's own attention, timed on ``attnhub bench --host``'s steps beside
    attnhub's backends (dashed in the figure): ``unavailable(device)`` is None where it can
    run, else why not; ``run(step)`` times one of ``attnhub.bench.HOST_STEPS`` and returns an
    ``attnhub.bench.HostOverhead`` row labelled ``name``."""

    name: str
    unavailable: Callable[[str], str | None]
    run: Callable[[str], Any]


@hookspec
def attnhub_backends() -> list[type[AttentionBackend]]:  # type: ignore[empty-body]
    """Return the backend classes this plugin provides."""


@hookspec
def attnhub_commands() -> list[Command]:  # type: ignore[empty-body]
    """Return the ``attnhub`` subcommands this plugin adds."""


@hookspec
def attnhub_bench_comparisons() -> list[BenchComparison]:  # type: ignore[empty-body]
    """Return the direct kernel comparisons this plugin adds to ``attnhub bench``."""


@hookspec
def attnhub_host_comparisons() -> list[HostComparison]:  # type: ignore[empty-body]
    """Return the host-overhead comparisons this plugin adds to ``attnhub bench --host``."""
