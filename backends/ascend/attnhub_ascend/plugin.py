"""Registers the ``ascend`` backend (entry point ``ascend = "attnhub_ascend.plugin"`` in group
``attnhub``). Importing this module never imports ``torch_npu``: availability is probed when a
backend is asked for, so discovery works on machines without the CANN toolkit."""

from __future__ import annotations

from attnhub.backend import AttentionBackend
from attnhub.hookspecs import hookimpl
from attnhub_ascend.backend import AscendBackend


@hookimpl
def attnhub_backends() -> list[type[AttentionBackend]]:
    return [AscendBackend]
