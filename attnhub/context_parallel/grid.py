"""Decode x prefill context parallel grids (vLLM's DCP x PCP): which grids run, which ranks form
which group, and one attention step over a grid.

vLLM's rule (``vllm/config/parallel.py``, ``ParallelConfig``, the check after the EPLB ones):
with ``PCP = 1``, ``DCP`` divides ``TP`` (DCP reuses the tensor-parallel ranks); with
``PCP > 1``, ``DCP`` is 1, ``PCP`` or ``TP x PCP`` ("DCP must be disabled, span the PCP axis,
or span the full TP x PCP axis").

The groups (``vllm/distributed/parallel_state.py``, ``initialize_model_parallel``): the world's
ranks laid out ``[DP x PP, PCP, TP]`` (TP fastest); a TP group is a row of TP ranks, a PCP
group the ranks of one TP index along the PCP axis, and a DCP group (``DCP > 1``) ``DCP``
consecutive ranks of the layout transposed to ``[DP x PP, TP, PCP]`` (PCP fastest). With
``TP = PCP = 2``::

    rank = pcp * TP + tp      TP groups [0, 1] [2, 3]     PCP groups [0, 2] [1, 3]
    DCP = 2 (= PCP): [0, 2] [1, 3]                        DCP = 4 (= TP x PCP): [0, 2, 1, 3]

A DCP group spanning the PCP axis holds each TP rank's query heads ``PCP`` times: it is made
with each rank's head block (``head_owner``: the rank of its TP index among the group's), so
it gathers and merges each block once. Two orders of one group: torch's group rank is the
rank's place among the group's ranks sorted (``new_group`` sorts them: ``[0, 2, 1, 3]`` runs
its collectives in the order 0, 1, 2, 3), vLLM's ``rank_in_group`` its index in vLLM's list
(rank 1 is DCP rank 2 there). The collectives follow torch's; the KV shard a rank holds is
vLLM's (``shard_rank``), so each rank stores the tokens vLLM's would.

A step over a grid (:class:`GridAttention`), on every rank:

1. ``plan(batch)``: the PCP split of the step (``shard_prefill`` over the PCP group: the rank's
   rows, vLLM's head-tail split, decodes on every rank), then, with ``DCP > 1``, the DCP plan of
   the whole step over the DCP group (its KV shard); with ``DCP = 1``, the backend's build of
   the rank's chunks and of the whole step's real tokens, whose metadata every layer's write
   of every new key takes (its slots checked once, on the step's host copies). Every agreement
   and build settled over its group: a refusal on one rank is raised on every rank before the
   layer's collectives.
2. ``forward(impl, step, query, key, value, cache)`` with the rank's rows: the new keys and
   values (and, with ``DCP > 1``, the queries) exchanged over the PCP group into the step's
   order; with ``DCP > 1``, the DCP layer call over the whole step (each rank writes and
   attends over its shard of the KV cache, merged over the DCP group), the rank's rows of its
   result returned; with ``DCP = 1``, every rank writes every new key (the whole cache on
   every rank) and attends for its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from attnhub.backend import AttentionBackend, AttentionImpl, AttentionMetadata
from attnhub.batch import BatchMetadata
from attnhub.context_parallel.communication import AllGatherReduceScatter, ContextParallelGroup
from attnhub.context_parallel.dcp import DcpStep, DecodeContextParallel
from attnhub.context_parallel.prefill import PrefillShard
from attnhub.errors import InvalidInputError
from attnhub.kv_cache import PagedKVCache

#: Where vLLM states the grid rule :func:`check_grid` applies.
VLLM_GRID_RULE = "vllm/config/parallel.py (ParallelConfig: the TP / PCP / DCP check)"


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInputError(f"{name} = {value!r} must be a positive int")
    return value


def check_grid(*, tp: int, pcp: int, dcp: int) -> None:
    """Raises InvalidInputError, citing vLLM's rule, for a grid vLLM refuses."""
    tp, pcp, dcp = _positive("tp", tp), _positive("pcp", pcp), _positive("dcp", dcp)
    if pcp == 1 and tp % dcp:
        raise InvalidInputError(
            f"tp_size={tp} must be divisible by dcp_size={dcp}: without prefill context "
            f"parallel, DCP reuses the tensor-parallel ranks ({VLLM_GRID_RULE})"
        )
    if pcp > 1 and dcp not in (1, pcp, tp * pcp):
        raise InvalidInputError(
            "when PCP is enabled, DCP must be disabled, span the PCP axis, or span the full "
            f"TP x PCP axis: got TP={tp}, PCP={pcp}, DCP={dcp}; valid DCP sizes are "
            f"{sorted({1, pcp, tp * pcp})} ({VLLM_GRID_RULE})"
        )


@dataclass(frozen=True)
class GridRanks:
    """Every group of a grid, as lists of world ranks in group order (vLLM's)."""

    tp: list[list[int]]
    pcp: list[list[int]]
    dcp: list[list[int]]

    @staticmethod
    def of(rank: int, groups: list[list[int]]) -> list[int]:
        """The group of ``groups`` that holds ``rank``."""
        return next(g for g in groups if rank in g)


def grid_ranks(world_size: int, *, tp: int, pcp: int, dcp: int) -> GridRanks:
    """The TP, PCP and DCP groups of ``world_size`` ranks as vLLM makes them (the module
    docstring; data and pipeline parallel outermost). Raises InvalidInputError for a grid
    vLLM refuses or a world size that is not a multiple of ``tp x pcp``."""
    check_grid(tp=tp, pcp=pcp, dcp=dcp)
    world_size = _positive("world_size", world_size)
    if world_size % (tp * pcp):
        raise InvalidInputError(
            f"world_size = {world_size} is not a multiple of TP x PCP = {tp * pcp}"
        )
    layout = torch.arange(world_size).reshape(-1, pcp, tp)  # [DP x PP, PCP, TP]
    along_pcp = layout.transpose(1, 2)  # [DP x PP, TP, PCP]
    dcp_layout = along_pcp if dcp > 1 else layout
    return GridRanks(
        tp=layout.reshape(-1, tp).tolist(),
        pcp=along_pcp.reshape(-1, pcp).tolist(),
        dcp=dcp_layout.reshape(-1, dcp).tolist(),
    )


def _agreed_grid(
    world: int, tp: object, pcp: object, dcp: object, device: torch.device
) -> GridRanks:
    """The grid's groups, once every rank of the default group found the same sizes valid (one
    all-gather of ``[accepted, tp, pcp, dcp]``): a grid refused or sized otherwise on any rank
    raises InvalidInputError on every rank before the groups' collective creation."""
    sizes = [s if isinstance(s, int) and not isinstance(s, bool) else -1 for s in (tp, pcp, dcp)]
    try:
        ranks: GridRanks | None = grid_ranks(world, tp=tp, pcp=pcp, dcp=dcp)  # type: ignore[arg-type]
        error: InvalidInputError | None = None
    except InvalidInputError as exc:
        ranks, error = None, exc
    mine = torch.tensor([error is None, *sizes], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    table = torch.stack(every).cpu().tolist()
    if error is not None:
        raise error
    refused = [r for r, row in enumerate(table) if not row[0]]
    if refused:
        raise InvalidInputError(
            f"rank(s) {refused} refused their grid (their own error says why); this rank "
            "refuses it with them"
        )
    for i, name in enumerate(("tp", "pcp", "dcp"), start=1):
        if len({row[i] for row in table}) > 1:
            shown = ", ".join(f"rank {r}: {row[i]}" for r, row in enumerate(table))
            raise InvalidInputError(f"the ranks were given different grids: {name} ({shown})")
    assert ranks is not None
    return ranks


class ContextParallelGrid:
    """This rank's groups of a grid over the default process group (every rank of it makes
    one, with the same sizes: ``torch.distributed.new_group`` is collective; sizes that differ
    between ranks, or a grid vLLM refuses on any rank, raise InvalidInputError on every rank
    first, after one all-gather of the sizes). ``variant``:
    the :class:`ContextParallelGroup` class of the DCP merge; ``device``: the collectives'
    device (as :class:`ContextParallelGroup`'s)."""

    def __init__(
        self,
        *,
        tp: int,
        pcp: int,
        dcp: int,
        variant: type[ContextParallelGroup] = AllGatherReduceScatter,
        device: torch.device | str = "cpu",
    ) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        self.ranks = _agreed_grid(world, tp, pcp, dcp, torch.device(device))
        self.tp_size, self.pcp_size, self.dcp_size = tp, pcp, dcp
        made: dict[str, Any] = {}
        for name in ("tp", "dcp", "pcp"):  # vLLM's order; every rank makes every group
            for ranks in getattr(self.ranks, name):
                group = dist.new_group(ranks)
                if rank in ranks:
                    made[name] = group
        dcp_ranks = self.ranks.of(rank, self.ranks.dcp)
        tp_of = {r: r % tp for r in dcp_ranks}  # a rank's TP index (TP fastest in the layout)
        blocks = sorted(set(tp_of.values()))
        #: Each rank of this rank's DCP group's head block, in torch's group order.
        self.head_owner = [blocks.index(tp_of[r]) for r in sorted(dcp_ranks)]
        #: This rank's index in its TP group (its query heads' block of the model's).
        self.tp_rank = self.ranks.of(rank, self.ranks.tp).index(rank)
        #: The PCP group's collectives (None where PCP = 1).
        self.pcp: ContextParallelGroup | None = (
            ContextParallelGroup(made["pcp"], device=device) if pcp > 1 else None
        )
        #: The DCP group's (None where DCP = 1); spanning the PCP axis, it holds each TP
        #: rank's heads PCP times; its KV shard is vLLM's DCP rank's.
        self.dcp: ContextParallelGroup | None = None
        if dcp > 1:
            self.dcp = variant(
                made["dcp"], device=device, head_owner=self.head_owner,
                shard_rank=dcp_ranks.index(rank),
            )  # fmt: skip


@dataclass(frozen=True)
class GridStep:
    """One step's plan on one rank of a grid, read by every layer."""

    batch: BatchMetadata  # the whole step
    rows: torch.Tensor  # [local_tokens] int64: the step's rows this rank computes
    prefill: PrefillShard | None  # the PCP split (None where PCP = 1)
    dcp: DcpStep | None  # the DCP plan of the whole step (None where DCP = 1)
    meta: AttentionMetadata | None  # DCP = 1: the backend's metadata of the rank's chunks
    #: DCP = 1 with PCP: the backend's metadata of the step's real tokens, which each layer's
    #: write of every new key takes (``write_kv(meta=)``: slots checked once per step, on host
    #: data; a write given the slot mapping itself would copy it to the host on every layer).
    written: AttentionMetadata | None = None
    #: DCP with PCP: ``rows`` on the backend's device, copied once per step (each layer picks
    #: the rank's rows of the merged result with it).
    device_rows: torch.Tensor | None = None


class GridAttention:
    """One layer call for ``backend`` (the rank's spec: its TP heads; with DCP, the KV heads
    every rank of the DCP group holds) on one rank of ``grid`` (see the module docstring).
    ``interleave``: DCP's (vLLM's ``cp_kv_cache_interleave_size``); ``decode_threshold``:
    PCP's (requests of at most this many new tokens are computed on every rank)."""

    def __init__(
        self,
        backend: AttentionBackend,
        grid: ContextParallelGrid,
        *,
        interleave: int = 1,
        decode_threshold: int = 1,
    ) -> None:
        self.backend = backend
        self.grid = grid
        self.decode_threshold = decode_threshold
        self.dcp: DecodeContextParallel | None = None
        if grid.dcp is not None:
            self.dcp = DecodeContextParallel(
                backend, grid.dcp, world_size=grid.dcp_size, interleave=interleave
            )
        self._builder = backend.metadata_builder() if self.dcp is None else None

    def plan(self, batch: BatchMetadata) -> GridStep:
        """This rank's plan of ``batch`` (the whole step, on every rank of the grid): raises
        on every rank of a group where any of its ranks refuses."""
        spec, pcp = self.backend.spec, self.grid.pcp
        prefill = None
        rows = torch.arange(batch.num_tokens)
        if pcp is not None:
            prefill = pcp.shard_prefill(
                batch, world_size=self.grid.pcp_size, decode_threshold=self.decode_threshold,
                spec=spec,
            )  # fmt: skip
            rows = prefill.token_rows
        if self.dcp is not None:
            on_device = None if prefill is None else rows.to(self.backend.device)
            return GridStep(batch, rows, prefill, self.dcp.plan(batch), None, None, on_device)
        assert self._builder is not None
        if pcp is None or prefill is None:  # neither: the rank's own step
            return GridStep(batch, rows, None, None, self._builder.build(batch))
        builder, chunks, real = self._builder, prefill.batch, _real_tokens(batch)
        meta, written = pcp.settle(
            lambda: (builder.build(chunks), builder.build(real)), "the prefill metadata builds"
        )
        return GridStep(batch, rows, prefill, None, meta, written)

    def forward(
        self,
        impl: AttentionImpl,
        step: GridStep,
        query: torch.Tensor,  # [local_tokens, Hl, D]: the rank's rows, its heads
        key: torch.Tensor,  # [local_tokens, K, D]
        value: torch.Tensor,
        cache: PagedKVCache,  # the rank's: its DCP shard, or the whole cache where DCP = 1
    ) -> torch.Tensor:  # [local_tokens, Hl, D]
        """The layer's attention for the rank's rows and heads, equal to the single-rank
        attention of the whole step there."""
        rows = step.rows.shape[0]
        for name, x in (("query", query), ("key", key), ("value", value)):
            if x.dim() != 3 or x.shape[0] != rows:
                raise InvalidInputError(
                    f"{name} must be [{rows}, heads, head_size] (the rank's rows of the step), "
                    f"got {list(x.shape)}"
                )
        pcp, shard = self.grid.pcp, step.prefill
        if self.dcp is None:  # PCP alone: every rank keeps the whole cache
            assert step.meta is not None
            if pcp is None or shard is None:  # neither: the rank's own step
                return impl.forward(query, key, value, cache, step.meta)
            k_all, v_all = pcp.exchange(key, shard), pcp.exchange(value, shard)
            assert step.written is not None  # plan's, with the PCP split
            impl.write_kv(k_all, v_all, cache, meta=step.written)  # the step's real tokens
            return impl.forward(query, key, value, cache, step.meta)
        assert step.dcp is not None
        if pcp is not None and shard is not None:  # every row of the step, padded
            query, key, value = (
                _pad(pcp.exchange(x, shard), step.batch.num_tokens) for x in (query, key, value)
            )
        out = self.dcp.forward(impl, step.dcp, query, key, value, cache)
        assert isinstance(out, torch.Tensor)
        if shard is None:
            return out
        assert step.device_rows is not None  # plan's, with the PCP split
        return out[step.device_rows]


def _real_tokens(batch: BatchMetadata) -> BatchMetadata:
    """``batch`` without its padding rows (the slot mapping of its real tokens: views, no
    copy), the rows the PCP exchange gives back."""
    n = batch.num_actual_tokens
    if batch.num_tokens == n:
        return batch
    host = batch.slot_mapping_cpu
    return replace(
        batch,
        slot_mapping=batch.slot_mapping[:n],
        slot_mapping_cpu=None if host is None else host[:n],
    )


def _pad(rows: torch.Tensor, n: int) -> torch.Tensor:
    """``rows`` followed by zero rows up to ``n``."""
    if rows.shape[0] == n:
        return rows
    return torch.cat([rows, rows.new_zeros((n - rows.shape[0], *rows.shape[1:]))])
