"""vLLM's decode context parallel (``decode_context_parallel_size`` N > 1) through attnhub's
sharding: ``attnhub.context_parallel.DecodeContextParallel`` over vLLM's own DCP group.

vLLM's calling convention under DCP (vLLM 0.32, its GQA backends' ``_forward_with_dcp``): the
model runner hands the builder the step as the engine schedules it (``seq_lens`` of whole
requests, a block table of virtual blocks of ``N x B`` tokens) and the layers the rank's
``Hl`` query heads, the step's new keys and values (the KV heads, replicated over the DCP
group) and the rank's shard of the cache with vLLM's DCP-local slot mapping (-1: another
rank's token). Everything else, the query heads' all-gather, the attention over the shard with
its LSE, and the merge over the group, is the impl's. That is exactly the contract of
``DecodeContextParallel`` (docs/context-parallel.md), so the adapter uses it whole:

- builder, once per step: ``dcp.plan(batch)`` on every rank (the step's agreement over vLLM's
  DCP ``cpu_group``, the shard, the metadata of the rank's one-token rows), and the check that
  attnhub's local slot mapping is vLLM's (the two shardings agree, or the step is refused);
- ``do_kv_cache_update``: the shard's write (the planned one, vLLM's slots);
- ``forward``: the head gather, the backend's ``forward(..., return_lse=True)`` over the shard
  for the group's heads, and attnhub's merge (all-gather + reduce-scatter, or all-to-all where
  vLLM's ``dcp_comm_backend`` is ``"a2a"``) over vLLM's DCP ``device_group``, sinks once.

Why not the backend's LSE handed to vLLM's own ``cp_lse_ag_out_rs``: that helper's correction
is a Triton kernel (``CorrectAttnCPOutKernel``), which vLLM's CPU build has no fallback for;
it takes an empty shard's LSE as -inf only through its ``mask_dcp_empty_shards_`` (attnhub's
backends give +inf for no key); sinks would have to be added after it, once; and a multi-token
row (vLLM's context and new-token parts, merged by a second LSE merge) would need the split
attnhub's one-token rows make unnecessary. attnhub's merge is plain ``torch.distributed`` on
the group vLLM made, so the same code runs on gloo, NCCL and HCCL.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from vllm.logger import init_logger

import attnhub
from attnhub import AttentionSpec, BatchMetadata, PagedKVCache
from attnhub.context_parallel import (
    AllGatherReduceScatter,
    AllToAll,
    DcpStep,
    DecodeContextParallel,
    dcp_unsupported_reasons,
    shard_step,
)
from attnhub.mla import LatentKVCache
from attnhub_vllm.mapping import AttnhubConfigurationError, batch_from_common, decode_batch

logger = init_logger("vllm.attnhub_vllm")


def declares_lse(backend: attnhub.AttentionBackend, spec: AttentionSpec) -> bool:
    """vLLM's ``can_return_lse_for_decode`` for a layer served by ``backend``: the backend
    declares the LSE of ``spec`` (``Capabilities.lse``), sinks aside (under DCP the kernel runs
    without them; they enter once, in the merge)."""
    return backend.capabilities.lse.refusal(replace(spec, use_sinks=False)) is None


def dcp_size(vllm_config: Any) -> int:
    """vLLM's configured ``decode_context_parallel_size`` (1 without a config)."""
    if vllm_config is None:
        return 1
    return int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)


def refuse_unserved(backend: attnhub.AttentionBackend, spec: Any, n: int) -> None:
    """At engine start (the layer's construction): why ``backend`` cannot serve ``spec`` under
    decode context parallel over ``n`` ranks, raised with every reason. vLLM's own check
    (vllm/v1/worker/cp_utils.py, ``check_attention_cp_compatibility``) would otherwise stop
    the engine later, naming only that the impl returns no LSE."""
    reasons = dcp_unsupported_reasons(type(backend), spec)
    if reasons:
        raise AttnhubConfigurationError(
            f"attnhub backend {backend.name!r} cannot serve vLLM's decode context parallel "
            f"(decode_context_parallel_size={n}) for this layer: "
            + "; ".join(r.sentence for r in reasons)
        )


@dataclass
class DcpLayerStep:
    """One step's DCP plan for one layer spec (the metadata a layer of that spec reads)."""

    dcp: DecodeContextParallel
    gathered_impl: Any  # the gathered backend's impl (no sinks): its write and its call
    step: DcpStep
    #: vLLM's DCP-local slot mapping of the step (``CommonAttentionMetadata.slot_mapping``),
    #: equal to the shard's (checked in ``plan``): a KV write vLLM hands these slots takes
    #: the planned write; any other slots, the checked write through them
    slots: torch.Tensor

    def write(
        self, key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache | LatentKVCache
    ) -> None:
        """The shard's KV write: the planned one (slots checked once per step in ``plan``; an
        MLA layer's: ``kv_c``, ``k_pe`` into its latent cache)."""
        self.gathered_impl.write_kv(key, value, cache, meta=self.step.meta)

    def partial(self, gathered: torch.Tensor, cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The rank's partial over its shard for the group's heads, as vLLM's MLA layer asks of
        ``forward_mqa`` under DCP (its layer gathers the query and merges: ``MLADCPManager``):
        ``gathered`` ``[T, N Hl, D]`` -> (output ``[T, N Hl, Dv]``, LSE ``[T, N Hl]`` float32,
        natural log). Rows that see no key of this rank: output 0 and LSE -inf (vLLM's merge
        weighs them 0; its ``mask_dcp_empty_shards_`` masks only whole empty requests)."""
        part, lse = self.gathered_impl.forward(
            gathered, None, None, cache, self.step.meta, return_lse=True
        )
        t = gathered.shape[0]
        empty = self.step.empty_rows[:t].to(part.device)
        lse = lse[:t].float().masked_fill(empty[:, None], float("-inf"))  # [T, N Hl]
        return part[:t].masked_fill(empty[:, None, None], 0), lse

    def forward(
        self, impl: Any, query: torch.Tensor, cache: PagedKVCache, out: torch.Tensor
    ) -> None:
        """The layer's attention for the rank's heads into ``out`` ``[T, Hl, D]`` (the rows
        past the step's tokens: 0): ``DecodeContextParallel.forward`` without its KV write
        (vLLM made it in ``do_kv_cache_update``). ``impl``: the rank's layer (its sinks)."""
        group = self.dcp.group
        gathered = group.gather_heads(query)
        part, lse = self.gathered_impl.forward(
            gathered, None, None, cache, self.step.meta, return_lse=True
        )
        merged, _ = group.combine(part, lse.t(), sinks=impl.sinks, empty_rows=self.step.empty_rows)
        out.copy_(merged)


class DcpPlanner:
    """The builder's DCP side: one ``DecodeContextParallel`` per distinct layer spec over
    vLLM's DCP group, planned once per step for every layer."""

    def __init__(self, backends: list[Any], vllm_config: Any, device: torch.device) -> None:
        from vllm.distributed.parallel_state import get_dcp_group

        parallel = vllm_config.parallel_config
        coordinator = get_dcp_group()
        variant = AllToAll if parallel.dcp_comm_backend == "a2a" else AllGatherReduceScatter
        self.world_size = int(parallel.decode_context_parallel_size)
        self.interleave = int(parallel.cp_kv_cache_interleave_size)
        group = variant(coordinator.device_group, device=device, check_group=coordinator.cpu_group)
        self.dcps = [
            DecodeContextParallel(
                backend, group, world_size=self.world_size, interleave=self.interleave
            )
            for backend in backends
        ]
        gathered = [d.gathered for d in self.dcps]  # None where refused: raised at plan
        self.impls = [None if g is None else g.impl() for g in gathered]
        self.builders = [None if g is None else g.metadata_builder() for g in gathered]
        self.block_size = backends[0].spec.block_size if backends else 0
        self.rank = group.rank
        logger.info_once(
            "attnhub-vllm: decode context parallel through attnhub: rank %d of %d, interleave "
            "%d, %s over vLLM's DCP group",
            self.rank, self.world_size, self.interleave, variant.__name__,
        )  # fmt: skip

    def plan(
        self, cm: Any, exact_maxima: bool, decodes: tuple[int, int] | None = None
    ) -> tuple[int, list[DcpLayerStep]]:
        """The step's plan for every spec, on every rank (``DecodeContextParallel.plan``, with
        one more check shared in the step's agreement: attnhub's local slot mapping is the
        one vLLM's model runner computed). A refusal, the step's or a spec's backend's, is
        raised on every rank before any collective of a layer. ``decodes`` = (requests,
        tokens): the step's first requests only (an MLA layer's decodes, which vLLM's MLA
        builder puts first: ``mapping.decode_batch``)."""
        virtual = self.world_size * self.block_size
        if decodes is None:
            batch = batch_from_common(cm, virtual, exact_maxima=exact_maxima)
        else:
            batch = decode_batch(cm, virtual, *decodes)
        steps = []
        for dcp, impl, builder in zip(self.dcps, self.impls, self.builders, strict=True):
            shard = dcp.agree_and_shard(batch, refusal=self._slot_refusal(batch))
            assert builder is not None  # a refused backend raised in the agreement
            flat, empty = dcp.flat_step(batch, shard, batch.device)
            step = DcpStep(shard, builder.build(flat), empty.to(batch.device))
            steps.append(DcpLayerStep(dcp, impl, step, batch.slot_mapping))
        return batch.num_actual_tokens, steps

    def _slot_refusal(self, batch: BatchMetadata) -> Exception | None:
        """Why this rank refuses the step where attnhub's local slot mapping is not vLLM's (the
        model runner's DCP slot-mapping kernel's): the two shardings disagree. Found before the
        step's agreement, so every rank raises (this one its own error)."""
        n = batch.num_actual_tokens
        try:
            ours = shard_step(
                batch, world_size=self.world_size, rank=self.rank, block_size=self.block_size,
                interleave=self.interleave,
            ).slot_mapping[:n]  # fmt: skip
        except Exception:  # the agreement raises it, with the same arguments, on every rank
            return None
        slots = batch.slot_mapping if batch.slot_mapping_cpu is None else batch.slot_mapping_cpu
        theirs = slots[:n].to(device="cpu", dtype=torch.int64)
        if torch.equal(ours, theirs):
            return None
        bad = int((ours != theirs).nonzero()[0, 0])
        return AttnhubConfigurationError(
            f"attnhub-vllm: vLLM's decode-context-parallel slot of token {bad} is "
            f"{int(theirs[bad])}, attnhub's sharding gives {int(ours[bad])} (rank {self.rank} "
            f"of {self.world_size}, interleave {self.interleave})"
        )
