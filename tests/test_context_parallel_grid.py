"""Decode x prefill context parallel grids (``attnhub.context_parallel.grid``): vLLM's rule for
which grids run and its group layout, and a step over a TP = 2 x PCP = 2 grid of 4 gloo
processes spawned here (``attnhub_conformance.multi_rank``'s harness: a deadline for the
group, every process reaped on any failure) with DCP = 1, = PCP and = TP x PCP.

Every rank builds the same step from one seed (a decode, a prefill chunk with context, a first
prefill), computes its PCP rows for its TP heads through the built-in torch backend, keeps its
DCP shard of the KV cache (the whole cache where DCP = 1), and reports its rows' output against
the float64 single-rank reference of the whole step and whether its cache holds exactly its
shard.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from attnhub_conformance.hostsync import guard_tree, unguard
from attnhub_conformance.multi_rank import run_group

from attnhub import AttentionSpec, BatchMetadata, reference
from attnhub.context_parallel import (
    VLLM_GRID_RULE,
    AllGatherReduceScatter,
    AllToAll,
    ContextParallelGrid,
    GridAttention,
    check_grid,
    grid_ranks,
    local_slot_mapping,
    token_rank,
)
from attnhub.errors import InvalidInputError
from attnhub.testing import generator, num_blocks_for, shuffled_block_table
from attnhub.torch_backend.backend import TorchBackend

TP, PCP = 2, 2
BLOCK_SIZE = 4  # per rank
HEADS_PER_TP_RANK = 2
KV_HEADS = 2  # the model's; a TP rank holds its share, a DCP group spanning TP all of them
HEAD_SIZE = 16
PADDING_ROWS = 2
QUERY_LENS = [1, 9, 14]  # a decode, a prefill chunk with context, a first prefill
SEQ_LENS = [13, 21, 14]
#: (DCP size, merge, interleave): every DCP size vLLM allows on this grid.
GRIDS = [
    (1, "all_gather_reduce_scatter", 1),
    (PCP, "all_to_all", 1),
    (TP * PCP, "all_gather_reduce_scatter", BLOCK_SIZE),
    (TP * PCP, "all_to_all", 1),
]
VARIANTS = {"all_gather_reduce_scatter": AllGatherReduceScatter, "all_to_all": AllToAll}
DEADLINE_S = 120.0


def grid_id(grid: tuple[int, str, int]) -> str:
    dcp, variant, interleave = grid
    return f"DCP{dcp}-{variant}-I{interleave}"


# --- what every rank runs ------------------------------------------------------------------------


class _RowsNotCopied(torch.Tensor):
    """A step's rows (host data): a layer that copies them to the device fails. Regression:
    with DCP and PCP every layer copied them, a host-to-device copy per layer; plan now
    copies them once per step (``GridStep.device_rows``)."""

    def to(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a layer copied the step's rows (plan copies them once)")


def _grid_case(grid: ContextParallelGrid, interleave: int, seed: int) -> dict[str, Any]:
    dcp = grid.dcp_size
    g = generator(seed)
    virtual = dcp * BLOCK_SIZE
    num_blocks = num_blocks_for(SEQ_LENS, virtual)
    table = shuffled_block_table(SEQ_LENS, virtual, num_blocks, g)
    tokens = sum(QUERY_LENS)
    batch = BatchMetadata.from_lengths(
        QUERY_LENS, SEQ_LENS, table, virtual, num_tokens=tokens + PADDING_ROWS
    )
    # an accelerator's batch: host copies beside the device tensors, which only plan reads
    batch = replace(
        batch,
        block_table_cpu=batch.block_table.clone(),
        slot_mapping_cpu=batch.slot_mapping.clone(),
    )
    keys = [torch.randn(s, KV_HEADS, HEAD_SIZE, generator=g) for s in SEQ_LENS]
    values = [torch.randn(s, KV_HEADS, HEAD_SIZE, generator=g) for s in SEQ_LENS]
    query = torch.randn(tokens, TP * HEADS_PER_TP_RANK, HEAD_SIZE, generator=g)

    t = grid.tp_rank
    heads = slice(t * HEADS_PER_TP_RANK, (t + 1) * HEADS_PER_TP_RANK)
    per_tp = KV_HEADS // TP
    kv = slice(0, KV_HEADS) if dcp == TP * PCP else slice(t * per_tp, (t + 1) * per_tp)
    spec = AttentionSpec(
        num_heads=HEADS_PER_TP_RANK, num_kv_heads=kv.stop - kv.start, head_size=HEAD_SIZE,
        dtype=torch.float32, block_size=BLOCK_SIZE,
    )  # fmt: skip
    backend = TorchBackend(spec)
    impl = backend.impl()
    attn = GridAttention(backend, grid, interleave=interleave)
    cache = backend.allocate_kv_cache(num_blocks)
    dcp_rank = grid.dcp.shard_rank if grid.dcp is not None else 0
    for r, (q, s) in enumerate(zip(QUERY_LENS, SEQ_LENS, strict=True)):  # earlier steps' keys
        pos = torch.arange(s - q)
        if dcp > 1:
            slots = torch.from_numpy(local_slot_mapping(
                pos, torch.full_like(pos, r), table, BLOCK_SIZE, dcp, dcp_rank, interleave
            ))  # fmt: skip
        else:
            slots = table[r, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        impl.write_kv(keys[r][: s - q, kv], values[r][: s - q, kv], cache, slots)

    step = attn.plan(batch)
    rows = step.rows
    new_k = torch.cat([k[s - q :] for k, q, s in zip(keys, QUERY_LENS, SEQ_LENS, strict=True)])
    new_v = torch.cat([v[s - q :] for v, q, s in zip(values, QUERY_LENS, SEQ_LENS, strict=True)])
    # every layer under the host-sync guard: a host read of the step's device tensors or of its
    # metadata's (a sync on an accelerator, on every layer) raises
    guarded = replace(
        step,
        rows=step.rows.as_subclass(_RowsNotCopied),
        batch=guard_tree(step.batch, "the step's batch"),
        meta=guard_tree(step.meta, "the chunks' metadata"),
        written=guard_tree(step.written, "the write's metadata"),
    )
    out = unguard(attn.forward(impl, guarded, query[rows][:, heads], new_k[rows][:, kv],
                               new_v[rows][:, kv], cache))  # fmt: skip

    want = torch.zeros(tokens, TP * HEADS_PER_TP_RANK, HEAD_SIZE, dtype=torch.float64)
    start = 0
    for k, v, q in zip(keys, values, QUERY_LENS, strict=True):
        want[start : start + q], _ = reference.attention(
            query[start : start + q], k, v, scale=HEAD_SIZE**-0.5
        )
        start += q
    cache_errors = []
    for r, s in enumerate(SEQ_LENS):
        mine = torch.from_numpy(token_rank(torch.arange(s), dcp, interleave) == dcp_rank)
        held = int(mine.sum())
        k, v = reference.read_sequence(cache, table[r], held)
        if not (torch.equal(k, keys[r][mine][:, kv].double()) and
                torch.equal(v, values[r][mine][:, kv].double())):  # fmt: skip
            cache_errors.append(f"request {r}: the cache does not hold the rank's tokens")
    return dict(
        error=float((out.double() - want[rows][:, heads]).abs().max()),
        rows=rows.tolist(),
        cache_errors=cache_errors,
        ranks=grid.ranks,
        tp_rank=t,
        dcp_rank=dcp_rank,
    )


def _outcome(call: Any) -> tuple[str, str, int]:
    """What ``call`` raised (type, message), and then one all-reduce: every rank still in
    step (no rank left waiting in a collective) gives the world's size."""
    import torch.distributed as dist

    try:
        call()
        kind, message = "no error", ""
    except Exception as exc:
        kind, message = type(exc).__name__, str(exc)
    alive = torch.ones(1)
    dist.all_reduce(alive)
    return kind, message, int(alive.item())


def grid_rank(rank: int, n: int, job: dict[str, Any]) -> dict[str, Any]:
    """Every grid of GRIDS in turn on this rank of the world group, then bad grids."""
    found: dict[str, Any] = {}
    for i, (dcp, variant, interleave) in enumerate(GRIDS):
        grid = ContextParallelGrid(tp=TP, pcp=PCP, dcp=dcp, variant=VARIANTS[variant])
        found[grid_id((dcp, variant, interleave))] = _grid_case(grid, interleave, 300 + i)
    found["bad"] = {
        "ranks_given_other_grids": _outcome(
            lambda: ContextParallelGrid(tp=TP, pcp=PCP, dcp=TP * PCP if rank == 0 else PCP)
        ),
        "a_grid_vllm_refuses_on_one_rank": _outcome(
            lambda: ContextParallelGrid(tp=TP, pcp=PCP, dcp=3 if rank == n - 1 else PCP)
        ),
    }
    return found


@pytest.fixture(scope="module")
def reports() -> dict[int, Any]:
    job = dict(backend="torch", spec=None, device="cpu", emulate=False, sub_cases=[],
               extra=f"{__name__}:grid_rank")  # fmt: skip
    return {r: report["extra"] for r, report in run_group(TP * PCP, job, DEADLINE_S).items()}


# --- the specification -----------------------------------------------------------------------


@pytest.mark.parametrize("grid", GRIDS, ids=grid_id)
def test_a_grid_step_equals_the_single_rank_step_on_every_rank(
    reports: dict[int, Any], grid: tuple[int, str, int]
) -> None:
    for rank, report in reports.items():
        found = report[grid_id(grid)]
        assert found["error"] < 1e-5, (rank, found["error"])  # float32 against float64


@pytest.mark.parametrize("grid", GRIDS, ids=grid_id)
def test_every_rank_cache_holds_exactly_its_dcp_shard(
    reports: dict[int, Any], grid: tuple[int, str, int]
) -> None:
    for rank, report in reports.items():
        assert report[grid_id(grid)]["cache_errors"] == [], rank


@pytest.mark.parametrize("grid", GRIDS, ids=grid_id)
def test_the_pcp_group_of_each_tp_rank_computes_every_row_once(
    reports: dict[int, Any], grid: tuple[int, str, int]
) -> None:
    """Decodes on every rank of the PCP group, the prefills' rows split between them."""
    decodes = {row for row, q in zip(range(len(QUERY_LENS)), QUERY_LENS, strict=True) if q == 1}
    for pcp_group in grid_ranks(TP * PCP, tp=TP, pcp=PCP, dcp=grid[0]).pcp:
        rows = [reports[r][grid_id(grid)]["rows"] for r in pcp_group]
        assert all(decodes <= set(part) for part in rows)
        prefill_rows = sorted(x for part in rows for x in part if x not in decodes)
        assert prefill_rows == [x for x in range(sum(QUERY_LENS)) if x not in decodes]


def test_ranks_given_other_grids_all_refuse_before_making_groups(
    reports: dict[int, Any],
) -> None:
    shown = ", ".join(f"rank {r}: {TP * PCP if r == 0 else PCP}" for r in range(TP * PCP))
    for kind, message, alive in (reports[r]["bad"]["ranks_given_other_grids"] for r in reports):
        assert kind == InvalidInputError.__name__, message
        assert f"different grids: dcp ({shown})" in message
        assert alive == TP * PCP


def test_a_grid_vllm_refuses_on_one_rank_stops_every_rank(reports: dict[int, Any]) -> None:
    n = TP * PCP
    found = [reports[r]["bad"]["a_grid_vllm_refuses_on_one_rank"] for r in range(n)]
    assert found[n - 1][0] == InvalidInputError.__name__
    assert "valid DCP sizes are [1, 2, 4]" in found[n - 1][1]
    assert VLLM_GRID_RULE in found[n - 1][1]
    for kind, message, _ in found[: n - 1]:
        assert kind == InvalidInputError.__name__ and f"rank(s) [{n - 1}]" in message
    assert all(alive == n for _, _, alive in found)


def test_every_rank_builds_the_grid_vllm_lays_out(reports: dict[int, Any]) -> None:
    for rank, report in reports.items():
        for grid in GRIDS:
            found = report[grid_id(grid)]
            ranks = grid_ranks(TP * PCP, tp=TP, pcp=PCP, dcp=grid[0])
            assert found["ranks"] == ranks
            assert found["tp_rank"] == rank % TP
            # its KV shard is vLLM's DCP rank's: its index in vLLM's list of the group
            assert found["dcp_rank"] == ranks.of(rank, ranks.dcp).index(rank)


# --- without processes -----------------------------------------------------------------------


def _vllm_groups(world: int, tp: int, pcp: int, dcp: int) -> dict[str, list[list[int]]]:
    """vLLM's groups, said another way: rank = (outer * PCP + p) * TP + t; a TP group varies
    t, a PCP group p (t fixed), a DCP group (DCP > 1) runs over p fastest, then t."""

    def rank(outer: int, p: int, t: int) -> int:
        return (outer * pcp + p) * tp + t

    outers = range(world // (tp * pcp))
    tp_groups = [[rank(o, p, t) for t in range(tp)] for o in outers for p in range(pcp)]
    pcp_groups = [[rank(o, p, t) for p in range(pcp)] for o in outers for t in range(tp)]
    if dcp == 1:
        dcp_groups = [[r] for r in range(world)]
    else:
        order = [rank(o, p, t) for o in outers for t in range(tp) for p in range(pcp)]
        dcp_groups = [order[i : i + dcp] for i in range(0, world, dcp)]
    return dict(tp=tp_groups, pcp=pcp_groups, dcp=dcp_groups)


@pytest.mark.parametrize(
    ("world", "tp", "pcp", "dcp"),
    [(4, 2, 2, 1), (4, 2, 2, 2), (4, 2, 2, 4), (8, 2, 2, 4), (8, 4, 1, 2), (8, 1, 4, 4),
     (16, 2, 4, 8), (8, 2, 2, 2)],
)  # fmt: skip
def test_the_groups_are_vllms(world: int, tp: int, pcp: int, dcp: int) -> None:
    ranks = grid_ranks(world, tp=tp, pcp=pcp, dcp=dcp)
    want = _vllm_groups(world, tp, pcp, dcp)
    assert (ranks.tp, ranks.pcp, ranks.dcp) == (want["tp"], want["pcp"], want["dcp"])


@pytest.mark.parametrize(
    ("tp", "pcp", "dcp", "words"),
    [
        (2, 4, 2, "valid DCP sizes are [1, 4, 8]"),
        (2, 2, 8, "valid DCP sizes are [1, 2, 4]"),
        (4, 1, 3, "tp_size=4 must be divisible by dcp_size=3"),
    ],
)
def test_a_grid_vllm_refuses_is_refused_citing_the_rule(
    tp: int, pcp: int, dcp: int, words: str
) -> None:
    with pytest.raises(InvalidInputError) as info:
        check_grid(tp=tp, pcp=pcp, dcp=dcp)
    assert words in str(info.value) and VLLM_GRID_RULE in str(info.value)
    with pytest.raises(InvalidInputError):
        grid_ranks(tp * pcp * dcp, tp=tp, pcp=pcp, dcp=dcp)


def test_every_grid_vllm_allows_is_accepted() -> None:
    for tp in (1, 2, 4):
        for pcp in (1, 2, 4):
            allowed = {d for d in range(1, tp + 1) if tp % d == 0} if pcp == 1 else {
                1, pcp, tp * pcp}  # fmt: skip
            for dcp in allowed:
                check_grid(tp=tp, pcp=pcp, dcp=dcp)


def test_a_world_that_is_not_a_multiple_of_tp_x_pcp_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="world_size = 6 is not a multiple of TP x PCP = 4"):
        grid_ranks(6, tp=2, pcp=2, dcp=2)
