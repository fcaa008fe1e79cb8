"""The plugin surface: one hook. A backend distribution is a module with

    import attnhub

    @attnhub.hookimpl
    def attnhub_backends():
        return [MyBackend]

registered under the entry-point group ``attnhub`` in its pyproject.toml:

    [project.entry-points.attnhub]
    mybackend = "my_package.plugin"

Hooks run once, at discovery; never per attention call. The hook returns a list of
``AttentionBackend`` subclasses, each with a unique string ``name`` and its ``Capabilities``; a
plugin that breaks this, or has an ``@attnhub.hookimpl`` under another name (a misspelling such as
``attnhub_backend``), is listed as failed with that error. The built-in backend loads first, so a
plugin module may use it at import: ``Base = attnhub.get_backend("torch")``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from attnhub.backend import AttentionBackend

PROJECT = "attnhub"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def attnhub_backends() -> list[type[AttentionBackend]]:  # type: ignore[empty-body]
    """Return the backend classes this plugin provides."""
