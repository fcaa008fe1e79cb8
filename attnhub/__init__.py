"""attnhub: vendor-neutral paged attention for LLM inference engines.

spec = attnhub.AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128)
backend = attnhub.select_backend(spec, device="cpu")
cache = backend.allocate_kv_cache(num_blocks=1024)
meta = backend.metadata_builder().build(batch)        # once per step
out = backend.impl().forward(q, k, v, cache, meta)    # per layer
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The names below are imported on first use (PEP 562), so ``import attnhub`` does not import
# torch: ``attnhub --help`` answers at once. ``attnhub.X`` and ``from attnhub import X`` work as
# if everything were imported here; the TYPE_CHECKING block tells type checkers and readers
# where each name lives.
if TYPE_CHECKING:
    from attnhub import errors, reference
    from attnhub.backend import (
        AttentionBackend,
        AttentionImpl,
        AttentionMetadata,
        AttentionMetadataBuilder,
    )
    from attnhub.batch import (
        BatchMetadata,
        BatchReorder,
        DecodePrefillSplit,
        make_local_attention_virtual_batches,
        reorder_decodes_first,
        split_decodes_and_prefills,
    )
    from attnhub.capabilities import (
        FEATURES,
        AccuracyBound,
        Capabilities,
        GraphSupport,
        Refusal,
        Tolerance,
    )
    from attnhub.graphs import BatchDescriptor, CaptureSizes, GraphRunner
    from attnhub.hookspecs import hookimpl
    from attnhub.kv_cache import PagedKVCache
    from attnhub.registry import (
        BackendInfo,
        get_backend,
        list_backends,
        register_backend,
        select_backend,
    )
    from attnhub.spec import KV_CACHE_DTYPES, AttentionSpec, AttentionType

#: Where each public name lives (module -> names); submodules ``errors`` and ``reference`` too.
_HOMES = {
    "attnhub.backend": (
        "AttentionBackend",
        "AttentionImpl",
        "AttentionMetadata",
        "AttentionMetadataBuilder",
    ),
    "attnhub.batch": (
        "BatchMetadata",
        "BatchReorder",
        "DecodePrefillSplit",
        "make_local_attention_virtual_batches",
        "reorder_decodes_first",
        "split_decodes_and_prefills",
    ),
    "attnhub.capabilities": (
        "FEATURES",
        "AccuracyBound",
        "Capabilities",
        "GraphSupport",
        "Refusal",
        "Tolerance",
    ),
    "attnhub.graphs": ("BatchDescriptor", "CaptureSizes", "GraphRunner"),
    "attnhub.hookspecs": ("hookimpl",),
    "attnhub.kv_cache": ("PagedKVCache",),
    "attnhub.registry": (
        "BackendInfo",
        "get_backend",
        "list_backends",
        "register_backend",
        "select_backend",
    ),
    "attnhub.spec": ("KV_CACHE_DTYPES", "AttentionSpec", "AttentionType"),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use; else a submodule (as an eager
    ``__init__`` made ``attnhub.registry`` reachable after ``import attnhub``)."""
    home = _HOME.get(name)
    if home is not None:
        value = getattr(importlib.import_module(home), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "FEATURES",
    "KV_CACHE_DTYPES",
    "AccuracyBound",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionSpec",
    "AttentionType",
    "BackendInfo",
    "BatchDescriptor",
    "BatchMetadata",
    "BatchReorder",
    "Capabilities",
    "CaptureSizes",
    "DecodePrefillSplit",
    "GraphRunner",
    "GraphSupport",
    "PagedKVCache",
    "Refusal",
    "Tolerance",
    "__version__",
    "errors",
    "get_backend",
    "hookimpl",
    "list_backends",
    "make_local_attention_virtual_batches",
    "reference",
    "register_backend",
    "reorder_decodes_first",
    "select_backend",
    "split_decodes_and_prefills",
]
