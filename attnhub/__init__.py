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
# where each name lives (tests/test_package.py holds it equal to ``_HOMES``, the table the
# imports at run time read). ``__all__`` is built from that table, which ruff does not read, so
# it counts the block's names as unused:
# ruff: noqa: F401
if TYPE_CHECKING:
    from attnhub import errors, reference
    from attnhub.backend import (
        AttentionBackend,
        AttentionImpl,
        AttentionMetadata,
        AttentionMetadataBuilder,
        Step,
        scratch_field,
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
        BatchInvariance,
        Capabilities,
        GraphSupport,
        HeadSizeVSupport,
        LseSupport,
        MlaSupport,
        Refusal,
        Tolerance,
    )
    from attnhub.graphs import BatchDescriptor, CaptureSizes, GraphRunner
    from attnhub.hookspecs import BenchComparison, Command, HostComparison, hookimpl
    from attnhub.kv_cache import PagedKVCache
    from attnhub.mla import LatentKVCache, MLASpec
    from attnhub.mla_backend import MLAImpl, MLAMetadataBuilder
    from attnhub.registry import (
        BackendInfo,
        get_backend,
        list_backends,
        register_backend,
        select_backend,
    )
    from attnhub.spec import KV_CACHE_DTYPES, AttentionSpec, AttentionType
    from attnhub.torch_compile import (
        attention,
        attention_op,
        forward_context,
        register_layer,
        unregister_layer,
    )

#: Where each public name lives (module -> names); submodules ``errors`` and ``reference`` too.
_HOMES = {
    "attnhub.backend": (
        "AttentionBackend",
        "AttentionImpl",
        "AttentionMetadata",
        "AttentionMetadataBuilder",
        "Step",
        "scratch_field",
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
        "BatchInvariance",
        "Capabilities",
        "GraphSupport",
        "HeadSizeVSupport",
        "LseSupport",
        "MlaSupport",
        "Refusal",
        "Tolerance",
    ),
    "attnhub.graphs": ("BatchDescriptor", "CaptureSizes", "GraphRunner"),
    "attnhub.hookspecs": ("hookimpl", "Command", "BenchComparison", "HostComparison"),
    "attnhub.kv_cache": ("PagedKVCache",),
    "attnhub.mla": ("LatentKVCache", "MLASpec"),
    "attnhub.mla_backend": ("MLAImpl", "MLAMetadataBuilder"),
    "attnhub.registry": (
        "BackendInfo",
        "get_backend",
        "list_backends",
        "register_backend",
        "select_backend",
    ),
    "attnhub.spec": ("KV_CACHE_DTYPES", "AttentionSpec", "AttentionType"),
    "attnhub.torch_compile": (
        "attention",
        "attention_op",
        "forward_context",
        "register_layer",
        "unregister_layer",
    ),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}

#: Every public name, written once: the names of ``_HOMES``, the two public submodules and the
#: version (``from attnhub import *`` and ``dir(attnhub)`` read it).
__all__ = ["__version__", "errors", "reference", *_HOME]


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
