"""Registers the ``iluvatar`` backend (entry point ``iluvatar = "attnhub_iluvatar.plugin"`` in
group ``attnhub``). Importing this module never imports ``ixformer``: availability is probed when
a backend is asked for, so discovery works on machines without the CoreX SDK."""

from __future__ import annotations

from attnhub.backend import AttentionBackend
from attnhub.hookspecs import hookimpl
from attnhub_iluvatar.backend import IluvatarBackend


@hookimpl
def attnhub_backends() -> list[type[AttentionBackend]]:
    return [IluvatarBackend]
