"""Registers the ``flash`` backend (entry point ``flash = "attnhub_flash.plugin"`` in group
``attnhub``): the class of the provider ``ATTNHUB_FLASH_PROVIDER`` names, else of the best
importable one, else vLLM's fork (emulated on a machine without a GPU). Importing this module
imports no FlashAttention library: providers are probed by module spec only, and imported when
a backend is asked for."""

from __future__ import annotations

from attnhub.backend import AttentionBackend
from attnhub.hookspecs import hookimpl
from attnhub_flash.backend import backend_class


@hookimpl
def attnhub_backends() -> list[type[AttentionBackend]]:
    return [backend_class()]
