"""The built-in portable ``torch`` backend (default on CPU)."""

from attnhub.torch_backend.backend import (
    TorchAttentionImpl,
    TorchAttentionMetadata,
    TorchBackend,
    TorchMetadataBuilder,
)

__all__ = ["TorchAttentionImpl", "TorchAttentionMetadata", "TorchBackend", "TorchMetadataBuilder"]
