"""attnhub's CUDA backend: FlashAttention (vLLM's fork with its FA2 or FA3 kernels, upstream
FA2, FA3, FA4) natively, a CPU emulator elsewhere."""

from attnhub_flash.backend import (
    BACKENDS,
    CAPABILITIES,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashBackend,
    FlashFA2Backend,
    FlashFA3Backend,
    FlashFA4Backend,
    FlashMetadataBuilder,
    FlashVllmBackend,
    FlashVllmFA3Backend,
    FlashVllmFlashMLABackend,
    backend_class,
)

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "CAPABILITIES",
    "FlashAttentionImpl",
    "FlashAttentionMetadata",
    "FlashBackend",
    "FlashFA2Backend",
    "FlashFA3Backend",
    "FlashFA4Backend",
    "FlashMetadataBuilder",
    "FlashVllmBackend",
    "FlashVllmFA3Backend",
    "FlashVllmFlashMLABackend",
    "__version__",
    "backend_class",
]
