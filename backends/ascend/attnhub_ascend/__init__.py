"""attnhub's Huawei Ascend backend: ``torch_npu`` kernels natively, a CPU emulator elsewhere."""

from attnhub_ascend.backend import (
    AscendAttentionImpl,
    AscendAttentionMetadata,
    AscendBackend,
    AscendMetadataBuilder,
)

__version__ = "0.1.0"

__all__ = [
    "AscendAttentionImpl",
    "AscendAttentionMetadata",
    "AscendBackend",
    "AscendMetadataBuilder",
    "__version__",
]
