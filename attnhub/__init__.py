"""attnhub: vendor-neutral paged attention for LLM inference engines.

spec = attnhub.AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128)
backend = attnhub.select_backend(spec, device="cpu")
cache = backend.allocate_kv_cache(num_blocks=1024)
meta = backend.metadata_builder().build(batch)        # once per step
out = backend.impl().forward(q, k, v, cache, meta)    # per layer
"""

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
from attnhub.capabilities import FEATURES, Capabilities, GraphSupport, Refusal, Tolerance
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

__version__ = "0.1.0"

__all__ = [
    "FEATURES",
    "KV_CACHE_DTYPES",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionSpec",
    "AttentionType",
    "BackendInfo",
    "BatchMetadata",
    "BatchReorder",
    "Capabilities",
    "DecodePrefillSplit",
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
