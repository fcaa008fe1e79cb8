"""Device-graph capture and replay for any backend (docs/graphs.md).

- :class:`GraphRunner` (``runner``): one graph per :class:`BatchDescriptor`, captured on first
  use, replayed afterwards, with persistent buffers and per-step backend updates;
- :class:`CaptureSizes` (``sizes``), :func:`pad_batch` (``padding``);
- adaptors behind :class:`GraphAdaptor` (``adaptor``): :class:`EagerAdaptor` (a recorded tape,
  any device), :class:`CUDAGraphAdaptor`, :class:`NPUGraphAdaptor`.
"""

from __future__ import annotations

import torch

from attnhub.graphs.adaptor import CapturedGraph, GraphAdaptor
from attnhub.graphs.cuda import CUDAGraphAdaptor
from attnhub.graphs.descriptor import BatchDescriptor, describe
from attnhub.graphs.eager import EagerAdaptor
from attnhub.graphs.errors import BatchTooLargeError, GraphCaptureError, NotCapturableBatchError
from attnhub.graphs.npu import NPUGraphAdaptor
from attnhub.graphs.padding import PaddedStep, pad_batch
from attnhub.graphs.runner import GraphRunner
from attnhub.graphs.sizes import CaptureSizes
from attnhub.graphs.tape import Tape

__all__ = [
    "BatchDescriptor",
    "BatchTooLargeError",
    "CUDAGraphAdaptor",
    "CaptureSizes",
    "CapturedGraph",
    "EagerAdaptor",
    "GraphAdaptor",
    "GraphCaptureError",
    "GraphRunner",
    "NPUGraphAdaptor",
    "NotCapturableBatchError",
    "PaddedStep",
    "Tape",
    "default_adaptor",
    "describe",
    "pad_batch",
]


def default_adaptor(device: torch.device | str) -> GraphAdaptor:
    """CUDA graphs on a CUDA device; the eager tape anywhere else."""
    if torch.device(device).type == "cuda":
        return CUDAGraphAdaptor(device)
    return EagerAdaptor()
