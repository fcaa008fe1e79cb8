"""The backend author's kit: what a backend package or an engine integration may import from
attnhub besides the public API (``attnhub``'s top-level names, ``attnhub.errors``,
``attnhub.reference``, ``attnhub.testing``). Everything else in the core may change without
notice; tests/test_kit.py fails when a backend or integration in this repository imports it.

  vendor library    VendorLibrary, import_once, EMULATE_HINT, EMULATED_DEVICE, device_type
  KV writes         flat_slots, write_slots, read_slots, FixedShapeWrite (a captured step's),
                    store_latent_rows (an MLA step's latents, after its checks),
                    read_latent_rows (latents read back, fp8 dequantized: e.g. a
                    prefill's cached context)
  LSE merge         merge_attn_states
  emulation         emulation (OpLog, kernel, null_kernels, preallocated, skip, timed)
  graph capture     Tape, TapeEntry (the op tape of a captured step), kernel_call (an
                    emulated kernel as one tape entry), recording_tape, NPUGraphAdaptor;
                    for an engine that captures through its own graph wrapper: GraphAdaptor,
                    PersistentBatch, pad_batch, uniform_query_len
  step facts        StepExtents (what layers compare), check_extents (a step's extents
                    against a cache: for an engine's own graph replay, which runs no layer
                    check), StepFacts (what build's checks read: ``Step.facts``), same_view,
                    as_contiguous
  checked values    CheckedStates, tensor_state (a tensor's values checked once per change of
                    it, not per step: e.g. a static scale read on the host)
  cache layout      BlockPacking (a kernel's element order inside an HND block)
  dtypes            MODEL_DTYPES, indexable, quantize_fp8, QueryQuantization
  bench plugins     BenchUnavailable, DirectComparison, machine, HostOverhead, host_step,
                    per_call_us (imported on first use)

docs/writing-a-backend.md says what each is for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from attnhub import emulation
from attnhub.backend import device_type
from attnhub.batch import as_contiguous
from attnhub.graphs import GraphAdaptor, NPUGraphAdaptor, pad_batch
from attnhub.graphs.buffers import PersistentBatch
from attnhub.graphs.descriptor import uniform_query_len
from attnhub.graphs.tape import Tape, TapeEntry, kernel_call, recording_tape
from attnhub.kv_cache import BlockPacking
from attnhub.kv_write import FixedShapeWrite, flat_slots, read_slots, write_slots
from attnhub.lse import merge_attn_states
from attnhub.mla import read_latent_rows, store_latent_rows
from attnhub.quant import QueryQuantization, indexable, quantize_fp8
from attnhub.spec import MODEL_DTYPES
from attnhub.validation import (
    CheckedStates,
    StepExtents,
    StepFacts,
    check_extents,
    same_view,
    tensor_state,
)
from attnhub.vendor import EMULATE_HINT, EMULATED_DEVICE, VendorLibrary, import_once

if TYPE_CHECKING:
    from attnhub.bench import (
        BenchUnavailable,
        DirectComparison,
        HostOverhead,
        host_step,
        machine,
        per_call_us,
    )

#: Tooling a backend's bench comparison plugin uses: imported on first use, so a backend that
#: imports the kit does not load the benchmark harness.
_BENCH = (
    "BenchUnavailable",
    "DirectComparison",
    "HostOverhead",
    "host_step",
    "machine",
    "per_call_us",
)


def __getattr__(name: str) -> Any:
    if name in _BENCH:
        return getattr(importlib.import_module("attnhub.bench"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "EMULATED_DEVICE",
    "EMULATE_HINT",
    "MODEL_DTYPES",
    "BenchUnavailable",
    "BlockPacking",
    "CheckedStates",
    "DirectComparison",
    "FixedShapeWrite",
    "GraphAdaptor",
    "HostOverhead",
    "NPUGraphAdaptor",
    "PersistentBatch",
    "QueryQuantization",
    "StepExtents",
    "StepFacts",
    "Tape",
    "TapeEntry",
    "VendorLibrary",
    "as_contiguous",
    "check_extents",
    "device_type",
    "emulation",
    "flat_slots",
    "host_step",
    "import_once",
    "indexable",
    "kernel_call",
    "machine",
    "merge_attn_states",
    "pad_batch",
    "per_call_us",
    "quantize_fp8",
    "read_latent_rows",
    "read_slots",
    "recording_tape",
    "same_view",
    "store_latent_rows",
    "tensor_state",
    "uniform_query_len",
    "write_slots",
]
