"""Registers the built-in backend through the same hook as any third-party plugin."""

from __future__ import annotations

from attnhub.backend import AttentionBackend
from attnhub.hookspecs import hookimpl
from attnhub.torch_backend.backend import TorchBackend


@hookimpl
def attnhub_backends() -> list[type[AttentionBackend]]:
    return [TorchBackend]
