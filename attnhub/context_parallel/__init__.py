"""Context parallel attention: a request's KV cache sharded over the ranks of a
``torch.distributed`` group (vLLM's decode context parallel), vendor-neutral.

  sharding       which rank holds which token; a rank's lengths, slot mapping and table
  prefill        prefill context parallel: a long prefill's query tokens split over the ranks
  dcp            decode context parallel through a backend: the layer call over a rank's shard
  graphs         DCP steps captured in device graphs (DcpGraphRunner)
  grid           DCP x PCP grids: vLLM's rule and group layout, a step over a grid
  merge          the ranks' partial attentions merged by their LSEs; sinks added once
  communication  the collectives of a step over a process group: the step agreement check,
                 the query heads' gather, the merge (all-gather + reduce-scatter, or
                 all-to-all), and the prefill rows' exchange

docs/context-parallel.md describes the arithmetic, the merge and the communication variants.
"""

from __future__ import annotations

from attnhub.context_parallel.communication import (
    FINGERPRINT_FIELDS,
    LAYOUT_FIELDS,
    SPEC_FIELDS,
    AllGatherReduceScatter,
    AllToAll,
    ContextParallelGroup,
    step_fingerprint,
)
from attnhub.context_parallel.dcp import (
    DcpStep,
    DecodeContextParallel,
    dcp_unsupported_reasons,
)
from attnhub.context_parallel.graphs import (
    CAPTURABLE_COLLECTIVES,
    DcpGraphRunner,
    collective_refusal,
)
from attnhub.context_parallel.grid import (
    VLLM_GRID_RULE,
    ContextParallelGrid,
    GridAttention,
    GridRanks,
    GridStep,
    check_grid,
    grid_ranks,
)
from attnhub.context_parallel.merge import (
    add_sinks,
    combine_partials,
    correct_partial,
    global_lse,
    mask_empty_rows,
)
from attnhub.context_parallel.prefill import PrefillShard, prefill_chunks, shard_prefill
from attnhub.context_parallel.sharding import (
    ContextShard,
    check_layout,
    local_positions,
    local_seq_lens,
    local_slot_mapping,
    shard_step,
    token_rank,
)

__all__ = [
    "CAPTURABLE_COLLECTIVES",
    "FINGERPRINT_FIELDS",
    "LAYOUT_FIELDS",
    "SPEC_FIELDS",
    "VLLM_GRID_RULE",
    "AllGatherReduceScatter",
    "AllToAll",
    "ContextParallelGrid",
    "ContextParallelGroup",
    "ContextShard",
    "DcpGraphRunner",
    "DcpStep",
    "DecodeContextParallel",
    "GridAttention",
    "GridRanks",
    "GridStep",
    "PrefillShard",
    "add_sinks",
    "check_grid",
    "check_layout",
    "collective_refusal",
    "combine_partials",
    "correct_partial",
    "dcp_unsupported_reasons",
    "global_lse",
    "grid_ranks",
    "local_positions",
    "local_seq_lens",
    "local_slot_mapping",
    "mask_empty_rows",
    "prefill_chunks",
    "shard_prefill",
    "shard_step",
    "step_fingerprint",
    "token_rank",
]
