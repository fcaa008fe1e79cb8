"""attnhub's Iluvatar CoreX backend: ``ixformer`` kernels natively, a CPU emulator elsewhere."""

from attnhub_iluvatar.backend import (
    IluvatarAttentionImpl,
    IluvatarAttentionMetadata,
    IluvatarBackend,
    IluvatarInt8AttentionImpl,
    IluvatarMetadataBuilder,
)

__version__ = "0.1.0"

__all__ = [
    "IluvatarAttentionImpl",
    "IluvatarAttentionMetadata",
    "IluvatarBackend",
    "IluvatarInt8AttentionImpl",
    "IluvatarMetadataBuilder",
    "__version__",
]
