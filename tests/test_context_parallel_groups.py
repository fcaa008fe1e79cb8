"""Context parallel over real process groups: gloo, 2 and 4 processes spawned here.

Each group runs once per world size (a module fixture, through
``attnhub_conformance.multi_rank``'s harness: bounded in time, a rank that dies fails the group
at once, every process reaped on any failure); the tests below read what each rank reported.
Every rank builds the same step from one seed, keeps only its shard of the KV cache (written
through its own slot mapping), attends over that shard with
``attnhub.reference`` (float64: the partial output and LSE over the local keys), merges through
``attnhub.context_parallel`` and compares with the single-rank reference of the whole step.

The step is split as vLLM's FlashAttention DCP path splits it: every query row over the rank's
share of the keys cached before the step (no causal mask: they all precede the row), merged
over the group; the step's new tokens against one another, causally, on every rank; the two
merged by their LSEs.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from attnhub_conformance.multi_rank import run_group

import attnhub
from attnhub import AttentionSpec, BatchMetadata, PagedKVCache, reference
from attnhub.context_parallel import (
    AllGatherReduceScatter,
    AllToAll,
    ContextParallelGroup,
    local_slot_mapping,
    token_rank,
)
from attnhub.errors import InvalidInputError, UnsupportedConfigurationError
from attnhub.testing import generator, num_blocks_for, shuffled_block_table
from attnhub.torch_backend.backend import TorchBackend

BLOCK_SIZE = 4  # per rank
LOCAL_HEADS = 2  # query heads per rank; the group gathers N of these
KV_HEADS = 2  # replicated on every rank of the group
HEAD_SIZE = 8
PADDING_ROWS = 2  # rows past the step's tokens (slot -1), as a graph-padded step has

#: (name, query_lens, seq_lens): one step of each kind vLLM schedules in a DCP group.
STEPS = [
    # request 1's one context token lives on rank 0 only; request 2 has no context at all
    ("decode", [1, 1, 1, 1], [13, 2, 1, 30]),
    ("multi_token_decode", [3, 2], [19, 4]),
    # decodes first, then a prefill chunk with context and a first chunk without
    ("chunked_prefill", [1, 6, 9], [11, 6, 25]),
]
INTERLEAVES = [1, BLOCK_SIZE]
VARIANTS = {"all_gather_reduce_scatter": AllGatherReduceScatter, "all_to_all": AllToAll}
CASES = [
    (step, interleave, variant, sinks)
    for step in STEPS
    for interleave in INTERLEAVES
    for variant in VARIANTS
    for sinks in (False, True)
]
#: Prefill context parallel: (name, query_lens, seq_lens).
PREFILL_STEPS = [
    ("long_prefill", [40], [40]),
    # decodes (computed whole on every rank) around a prefill chunk with context
    ("decodes_and_a_chunk_with_context", [1, 29, 1], [12, 40, 8]),
    # too few tokens for every rank: with 4 ranks, rank 3 has nothing to compute
    ("short_prefills", [2, 3], [2, 9]),
]
WORLD_SIZES = [2, 4]
DEADLINE_S = 240.0  # the whole group, start-up included (4 processes import torch on 2 cores)


def case_id(case: tuple[Any, ...]) -> str:
    (name, _, _), interleave, variant, sinks = case
    return f"{name}-I{interleave}-{variant}{'-sinks' if sinks else ''}"


# --- what every rank runs ------------------------------------------------------------------------


def _step_data(n: int, query_lens: list[int], seq_lens: list[int], seed: int) -> dict[str, Any]:
    """The step every rank builds alike: a table of virtual blocks (N x BLOCK_SIZE tokens),
    every request's keys and values, the query of every head, sinks."""
    g = generator(seed)
    virtual = n * BLOCK_SIZE
    num_blocks = num_blocks_for(seq_lens, virtual)
    table = shuffled_block_table(seq_lens, virtual, num_blocks, g)
    tokens = sum(query_lens)
    batch = BatchMetadata.from_lengths(
        query_lens, seq_lens, table, virtual, num_tokens=tokens + PADDING_ROWS
    )
    heads = n * LOCAL_HEADS
    keys = [torch.randn(s, KV_HEADS, HEAD_SIZE, generator=g) for s in seq_lens]
    values = [torch.randn(s, KV_HEADS, HEAD_SIZE, generator=g) for s in seq_lens]
    query = torch.randn(tokens + PADDING_ROWS, heads, HEAD_SIZE, generator=g)
    sinks = torch.randn(heads, generator=g) + 1.0
    return dict(batch=batch, num_blocks=num_blocks, keys=keys, values=values, query=query,
                sinks=sinks)  # fmt: skip


def _new_rows(
    query_lens: list[int], seq_lens: list[int], planes: list[torch.Tensor]
) -> torch.Tensor:
    """The step's new tokens' rows of ``planes`` (one per request), packed, PADDING_ROWS
    zero rows after."""
    rows = [p[s - q :] for p, q, s in zip(planes, query_lens, seq_lens, strict=True)]
    packed = torch.cat(rows)
    return torch.cat([packed, packed.new_zeros(PADDING_ROWS, *packed.shape[1:])])


def _run_case(comm: ContextParallelGroup, case: tuple[Any, ...], seed: int) -> dict[str, Any]:
    (_, query_lens, seq_lens), interleave, _, use_sinks = case
    n, rank = comm.world_size, comm.rank
    d = _step_data(n, query_lens, seq_lens, seed)
    batch: BatchMetadata = d["batch"]
    table = batch.block_table
    shard = comm.shard(batch, world_size=n, block_size=BLOCK_SIZE, interleave=interleave)

    # The rank's cache: the context earlier steps wrote, then this step's tokens, each through
    # this rank's slot mapping (another rank's token is a padding slot, never written).
    cache = PagedKVCache.allocate(d["num_blocks"], BLOCK_SIZE, KV_HEADS, HEAD_SIZE, torch.float32)
    for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        positions = torch.arange(s - q)
        slots = local_slot_mapping(
            positions, torch.full_like(positions, r), table, BLOCK_SIZE, n, rank, interleave
        )
        reference.write_kv(
            cache, d["keys"][r][: s - q], d["values"][r][: s - q], torch.from_numpy(slots)
        )
    reference.write_kv(
        cache,
        _new_rows(query_lens, seq_lens, d["keys"]),
        _new_rows(query_lens, seq_lens, d["values"]),
        shard.slot_mapping,
    )

    # Every rank's cache holds exactly its shard: its tokens, in order, and nothing else.
    shard_errors = []
    for r, s in enumerate(seq_lens):
        mine = torch.from_numpy(token_rank(torch.arange(s), n, interleave) == rank)
        k, v = reference.read_sequence(cache, table[r], int(shard.seq_lens[r]))
        if not (torch.equal(k, d["keys"][r][mine].double()) and
                torch.equal(v, d["values"][r][mine].double())):  # fmt: skip
            shard_errors.append(f"request {r}: the cache does not hold the rank's tokens")
    written = int((cache.key.reshape(-1, KV_HEADS * HEAD_SIZE) != 0).any(dim=1).sum())

    # The query of the group's heads.
    heads = slice(rank * LOCAL_HEADS, (rank + 1) * LOCAL_HEADS)
    query = comm.gather_heads(d["query"][:, heads])
    gathered_ok = torch.equal(query, d["query"])

    # Every row over the rank's share of the context; rows with none stay NaN (what a kernel
    # might leave there): the merge must ignore them.
    rows, h = batch.num_tokens, n * LOCAL_HEADS
    out = torch.full((rows, h, HEAD_SIZE), math.nan, dtype=torch.float64)
    lse = torch.full((h, rows), math.nan, dtype=torch.float64)
    qsl = batch.query_start_loc_cpu.tolist()
    scale = HEAD_SIZE**-0.5
    for r in range(batch.num_reqs):
        c = int(shard.context_lens[r])
        if c == 0:
            continue
        k, v = reference.read_sequence(cache, table[r], c)
        for row in range(qsl[r], qsl[r + 1]):
            o, l_ = reference.attention(query[row : row + 1], k, v, scale=scale, causal=False)
            out[row], lse[:, row] = o[0], l_[:, 0]
    sinks = d["sinks"][heads] if use_sinks else None
    ctx_out, ctx_lse = comm.combine(out, lse, sinks=sinks, empty_rows=shard.empty_context_rows())

    # The new tokens against one another, causally (no sinks: they entered once, above), and
    # the single-rank reference of the whole step.
    tokens = batch.num_actual_tokens
    self_out = torch.zeros(tokens, LOCAL_HEADS, HEAD_SIZE, dtype=torch.float64)
    self_lse = torch.zeros(LOCAL_HEADS, tokens, dtype=torch.float64)
    want = torch.zeros_like(self_out)
    want_lse = torch.zeros_like(self_lse)
    for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        rows_r = slice(qsl[r], qsl[r + 1])
        k_new, v_new = d["keys"][r][s - q :], d["values"][r][s - q :]
        o, l_ = reference.attention(query[rows_r], k_new, v_new, scale=scale)
        self_out[rows_r], self_lse[:, rows_r] = o[:, heads], l_[heads]
        o, l_ = reference.attention(
            query[rows_r], d["keys"][r], d["values"][r], scale=scale,
            sinks=d["sinks"] if use_sinks else None,
        )  # fmt: skip
        want[rows_r], want_lse[:, rows_r] = o[:, heads], l_[heads]
    got, got_lse = reference.merge_attn_states(
        ctx_out[:tokens], ctx_lse[:, :tokens], self_out, self_lse
    )
    return dict(
        out_error=float((got - want).abs().max()),
        lse_error=float((got_lse - want_lse).abs().max()),
        finite=bool(torch.isfinite(got).all() and torch.isfinite(ctx_out).all()),
        dtype=str(ctx_out.dtype),
        local_seq_lens=shard.seq_lens.tolist(),
        written_slots=written,
        shard_errors=shard_errors,
        gathered_ok=gathered_ok,
    )


def _run_prefill_case(
    comm: ContextParallelGroup, step: tuple[Any, ...], seed: int
) -> dict[str, Any]:
    """One step under prefill context parallel: each rank computes its rows of the step, the
    new keys and values are exchanged and written whole to every rank's cache, each rank
    attends for its rows, and the outputs are exchanged back into the step's order."""
    _, query_lens, seq_lens = step
    n = comm.world_size
    g = generator(seed)
    spec = AttentionSpec(num_heads=4, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                         dtype=torch.float32, block_size=BLOCK_SIZE)  # fmt: skip
    num_blocks = num_blocks_for(seq_lens, BLOCK_SIZE)
    table = shuffled_block_table(seq_lens, BLOCK_SIZE, num_blocks, g)
    tokens = sum(query_lens)
    batch = BatchMetadata.from_lengths(
        query_lens, seq_lens, table, BLOCK_SIZE, num_tokens=tokens + PADDING_ROWS
    )
    keys = [torch.randn(s, KV_HEADS, HEAD_SIZE, generator=g) for s in seq_lens]
    values = [torch.randn(s, KV_HEADS, HEAD_SIZE, generator=g) for s in seq_lens]
    query = torch.randn(tokens, spec.num_heads, HEAD_SIZE, generator=g)
    cache = PagedKVCache.for_spec(spec, num_blocks, "cpu")
    for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):  # earlier steps' keys
        p = torch.arange(s - q)
        slots = table[r, p // BLOCK_SIZE].long() * BLOCK_SIZE + p % BLOCK_SIZE
        reference.write_kv(cache, keys[r][: s - q], values[r][: s - q], slots)

    shard = comm.shard_prefill(batch, world_size=n)
    rows = shard.token_rows
    new_k = _new_rows(query_lens, seq_lens, keys)[:tokens]
    new_v = _new_rows(query_lens, seq_lens, values)[:tokens]
    all_k, all_v = comm.exchange(new_k[rows], shard), comm.exchange(new_v[rows], shard)
    exchanged_ok = torch.equal(all_k, new_k) and torch.equal(all_v, new_v)
    reference.write_kv(cache, all_k, all_v, batch.slot_mapping[:tokens])
    out, _ = reference.paged_attention(query[rows], cache, shard.batch, spec)
    got = comm.exchange(out, shard)
    want, _ = reference.paged_attention(query, cache, batch, spec)
    # a backend serves a rank's chunks as they are: the built-in one, through its forward
    before = cache.clone()
    backend = attnhub.select_backend(spec, "cpu", prefer="torch")
    meta = backend.metadata_builder().build(shard.batch)
    by_backend = backend.impl().forward(query[rows], new_k[rows], new_v[rows], cache, meta)
    backend_got = comm.exchange(by_backend, shard)
    return dict(
        out_error=float((got - want).abs().max()) if tokens else 0.0,
        backend_error=float((backend_got.double() - want).abs().max()) if tokens else 0.0,
        backend_wrote_nothing=cache.equal(before),
        exchanged_ok=exchanged_ok,
        local_tokens=int(rows.numel()),
        local_chunks=shard.batch.num_reqs,
        rank_tokens=list(shard.rank_tokens),
    )


def _outcome(call: Any) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


def _prefill_build(comm: ContextParallelGroup, spec: AttentionSpec) -> Any:
    """A prefill of 40 tokens split over the group, then a backend's build of the rank's
    chunks that refuses a sequence of 40 tokens: only rank 0's tail chunk ends there."""
    batch = BatchMetadata.from_lengths([40], [40], torch.arange(10).reshape(1, 10), BLOCK_SIZE)
    shard = comm.shard_prefill(batch, world_size=comm.world_size, spec=spec)
    builder = TorchBackend(spec).metadata_builder()

    def build() -> Any:
        longest = int(shard.batch.seq_lens_cpu.max())
        if longest >= 40:
            raise UnsupportedConfigurationError("torch", [f"seq_len {longest} is 40 or more"])
        return builder.build(shard.batch)

    return comm.settle(build, "the prefill chunks' metadata build")


def _bad_steps(comm: ContextParallelGroup) -> dict[str, tuple[str, str, int]]:
    """Bad input, one case after another on every rank; after each, one all-reduce shows the
    group still in step (no rank left waiting in a collective)."""
    n, rank = comm.world_size, comm.rank
    d = _step_data(n, [1, 3], [9, 7], seed=5)
    batch: BatchMetadata = d["batch"]
    other = _step_data(n, [1, 3], [10, 7], seed=5)["batch"]  # request 0 one token longer
    spec = AttentionSpec(num_heads=4, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                         dtype=torch.float32, block_size=BLOCK_SIZE)  # fmt: skip
    cases = {
        "wrong_group_size": lambda: comm.shard(batch, world_size=n + 1, block_size=BLOCK_SIZE),
        "interleave_not_dividing_block_size": lambda: comm.shard(
            batch, world_size=n, block_size=BLOCK_SIZE, interleave=3
        ),
        "ranks_disagree_on_seq_lens": lambda: comm.shard(
            other if rank == 0 else batch, world_size=n, block_size=BLOCK_SIZE
        ),
        "ranks_disagree_on_interleave": lambda: comm.shard(
            batch, world_size=n, block_size=BLOCK_SIZE, interleave=1 if rank else BLOCK_SIZE
        ),
        "prefill_of_a_non_causal_step": lambda: comm.shard_prefill(
            replace(batch, causal=False), world_size=n
        ),
        "ranks_disagree_on_the_kind_of_context_parallel": lambda: (
            comm.shard_prefill(batch, world_size=n)
            if rank == 0
            else comm.shard(batch, world_size=n, block_size=BLOCK_SIZE)
        ),
        "sinks_for_every_head_instead_of_the_ranks_own": lambda: comm.combine(
            torch.zeros(3, n * LOCAL_HEADS, HEAD_SIZE),
            torch.zeros(n * LOCAL_HEADS, 3),
            sinks=torch.zeros(n * LOCAL_HEADS),
        ),
        "a_check_failing_on_one_rank_only": lambda: comm.shard(
            replace(batch, max_query_len=99) if rank == 0 else batch,
            world_size=n,
            block_size=BLOCK_SIZE,
        ),
        "prefill_ranks_with_other_head_counts": lambda: comm.shard_prefill(
            batch, world_size=n, spec=replace(spec, num_heads=2) if rank == 0 else spec
        ),
        "prefill_build_failing_on_one_rank_only": lambda: _prefill_build(comm, spec),
        "one_rank_without_a_batch": lambda: comm.shard(
            None if rank == n - 1 else batch,  # type: ignore[arg-type]
            world_size=n,
            block_size=BLOCK_SIZE,
        ),
    }
    found = {}
    for name, call in cases.items():
        kind, message = _outcome(call)
        alive = torch.ones(1)
        dist.all_reduce(alive)
        found[name] = (kind, message, int(alive.item()))
    return found


def group_rank(rank: int, n: int, job: dict[str, Any]) -> dict[str, Any]:
    """Every case on this rank of the default (gloo) group the harness made."""
    report: dict[str, Any] = {"cases": {}, "prefill": {}, "bad": {}}
    check = dist.new_group(backend="gloo")  # the host group a step is checked on
    for i, case in enumerate(CASES):
        variant = VARIANTS[case[2]]
        comm = variant(check_group=check) if i % 2 else variant()
        report["cases"][case_id(case)] = _run_case(comm, case, seed=100 + i)
    for i, step in enumerate(PREFILL_STEPS):
        report["prefill"][step[0]] = _run_prefill_case(AllToAll(), step, seed=200 + i)
    report["bad"] = _bad_steps(AllGatherReduceScatter())
    return report


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"N{n}")
def group(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
    n: int = request.param
    job = dict(backend="torch", spec=None, device="cpu", emulate=False, sub_cases=[],
               extra=f"{__name__}:group_rank")  # fmt: skip
    return n, {r: report["extra"] for r, report in run_group(n, job, DEADLINE_S).items()}


# --- the specification -----------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_merged_shards_equal_the_single_rank_step(
    group: tuple[int, dict[int, Any]], case: tuple[Any, ...]
) -> None:
    _, reports = group
    for rank, report in reports.items():
        got = report["cases"][case_id(case)]
        assert got["dtype"] == "torch.float64"
        assert got["out_error"] < 1e-10, (rank, got)
        assert got["lse_error"] < 1e-10, (rank, got)


@pytest.mark.parametrize("case", CASES[::4], ids=case_id)
def test_every_rank_cache_holds_exactly_its_shard(
    group: tuple[int, dict[int, Any]], case: tuple[Any, ...]
) -> None:
    n, reports = group
    (_, _, seq_lens), _, _, _ = case
    local = [reports[r]["cases"][case_id(case)]["local_seq_lens"] for r in range(n)]
    assert [sum(col) for col in zip(*local, strict=True)] == seq_lens
    for rank, report in reports.items():
        got = report["cases"][case_id(case)]
        assert got["shard_errors"] == []
        assert got["written_slots"] == sum(got["local_seq_lens"]), rank


def test_a_rank_with_an_empty_shard_contributes_no_nan(group: tuple[int, dict[int, Any]]) -> None:
    n, reports = group
    for step in STEPS:
        for interleave in INTERLEAVES:
            case = (step, interleave, "all_to_all", False)
            local = [reports[r]["cases"][case_id(case)]["local_seq_lens"] for r in range(n)]
            assert any(0 in lens for lens in local) or step[0] != "decode"
    for rank, report in reports.items():
        for name, got in report["cases"].items():
            assert got["finite"], (rank, name)


def test_the_query_heads_are_gathered_in_rank_order(group: tuple[int, dict[int, Any]]) -> None:
    _, reports = group
    for report in reports.values():
        assert all(got["gathered_ok"] for got in report["cases"].values())


def _refusals(reports: dict[int, Any], name: str) -> list[tuple[str, str, int]]:
    return [reports[r]["bad"][name] for r in sorted(reports)]


def test_a_group_of_the_wrong_size_is_refused_on_every_rank(
    group: tuple[int, dict[int, Any]],
) -> None:
    n, reports = group
    for kind, message, alive in _refusals(reports, "wrong_group_size"):
        assert kind == InvalidInputError.__name__
        assert f"world_size = {n + 1}" in message and f"{n} ranks" in message
        assert alive == n


def test_an_interleave_that_does_not_divide_the_block_size_is_refused_on_every_rank(
    group: tuple[int, dict[int, Any]],
) -> None:
    n, reports = group
    for kind, message, alive in _refusals(reports, "interleave_not_dividing_block_size"):
        assert kind == InvalidInputError.__name__
        assert f"interleave = 3 does not divide block_size = {BLOCK_SIZE}" in message
        assert alive == n


@pytest.mark.parametrize(
    ("name", "field"),
    [("ranks_disagree_on_seq_lens", "seq_lens"), ("ranks_disagree_on_interleave", "interleave")],
)
def test_ranks_that_disagree_on_the_step_all_refuse_it(
    group: tuple[int, dict[int, Any]], name: str, field: str
) -> None:
    n, reports = group
    for kind, message, alive in _refusals(reports, name):
        assert kind == InvalidInputError.__name__
        assert "different steps" in message and f"{field} differs" in message
        assert alive == n


def test_sinks_of_the_wrong_heads_are_refused_on_every_rank_before_the_merge(
    group: tuple[int, dict[int, Any]],
) -> None:
    n, reports = group
    for kind, message, alive in _refusals(reports, "sinks_for_every_head_instead_of_the_ranks_own"):
        assert kind == InvalidInputError.__name__
        assert f"sinks must be [{LOCAL_HEADS}]" in message and f"({n * LOCAL_HEADS},)" in message
        assert alive == n


def test_a_check_that_fails_on_one_rank_only_stops_every_rank(
    group: tuple[int, dict[int, Any]],
) -> None:
    """A field the fingerprint does not carry (here a wrong max_query_len on rank 0): rank 0's
    own check refuses it before the gather, and the others learn it there."""
    n, reports = group
    refusals = _refusals(reports, "a_check_failing_on_one_rank_only")
    assert all(kind == InvalidInputError.__name__ and alive == n for kind, _, alive in refusals)
    assert "max_query_len = 99" in refusals[0][1]
    assert all("rank(s) [0]" in message for _, message, _ in refusals[1:])


def test_a_rank_that_cannot_read_its_step_takes_the_others_down_with_it(
    group: tuple[int, dict[int, Any]],
) -> None:
    n, reports = group
    refusals = _refusals(reports, "one_rank_without_a_batch")
    assert all(kind == InvalidInputError.__name__ and alive == n for kind, _, alive in refusals)
    assert "batch must be a BatchMetadata, got NoneType" in refusals[n - 1][1]
    assert all(f"rank(s) [{n - 1}]" in message for _, message, _ in refusals[: n - 1])


# --- prefill context parallel --------------------------------------------------------------


@pytest.mark.parametrize("step", PREFILL_STEPS, ids=lambda s: s[0])
def test_prefill_split_over_the_ranks_equals_the_single_rank_step(
    group: tuple[int, dict[int, Any]], step: tuple[Any, ...]
) -> None:
    _, reports = group
    for rank, report in reports.items():
        got = report["prefill"][step[0]]
        assert got["exchanged_ok"], rank
        assert got["out_error"] < 1e-10, (rank, got)


@pytest.mark.parametrize("step", PREFILL_STEPS, ids=lambda s: s[0])
def test_a_backend_serves_a_ranks_prefill_chunks_unchanged(
    group: tuple[int, dict[int, Any]], step: tuple[Any, ...]
) -> None:
    _, reports = group
    for rank, report in reports.items():
        got = report["prefill"][step[0]]
        assert got["backend_error"] < 1e-5, (rank, got)  # float32 against float64
        assert got["backend_wrote_nothing"], rank


def test_a_prefill_of_2n_equal_chunks_gives_every_rank_a_head_and_a_tail_chunk(
    group: tuple[int, dict[int, Any]],
) -> None:
    n, reports = group
    counts = [reports[r]["prefill"]["long_prefill"]["local_tokens"] for r in range(n)]
    assert counts == [40 // n] * n
    assert all(reports[r]["prefill"]["long_prefill"]["local_chunks"] == 2 for r in range(n))


def test_a_rank_with_no_prefill_rows_still_takes_part(group: tuple[int, dict[int, Any]]) -> None:
    n, reports = group
    counts = [reports[r]["prefill"]["short_prefills"]["local_tokens"] for r in range(n)]
    assert sum(counts) == 5
    if n == 4:
        assert counts[3] == 0


def test_prefill_ranks_whose_layers_have_other_head_counts_all_refuse_the_step(
    group: tuple[int, dict[int, Any]],
) -> None:
    n, reports = group
    shown = ", ".join(f"rank {r}: {2 if r == 0 else 4}" for r in range(n))
    for kind, message, alive in _refusals(reports, "prefill_ranks_with_other_head_counts"):
        assert kind == InvalidInputError.__name__, message
        assert f"spec.num_heads differs between ranks ({shown})" in message
        assert alive == n


def test_a_prefill_build_failing_on_one_rank_only_stops_every_rank(
    group: tuple[int, dict[int, Any]],
) -> None:
    """Rank 0's tail chunk ends the 40-token prefill: its build refuses, the others' do not;
    every rank raises, the others naming rank 0 and its reason."""
    n, reports = group
    refusals = _refusals(reports, "prefill_build_failing_on_one_rank_only")
    assert refusals[0][0] == UnsupportedConfigurationError.__name__
    assert "seq_len 40 is 40 or more" in refusals[0][1]
    for kind, message, _ in refusals[1:]:
        assert kind == InvalidInputError.__name__, message
        assert "metadata build failed on rank(s) [0]" in message
        assert "seq_len 40 is 40 or more" in message
    assert all(alive == n for _, _, alive in refusals)


def test_a_non_causal_step_is_refused_for_prefill_context_parallel_on_every_rank(
    group: tuple[int, dict[int, Any]],
) -> None:
    n, reports = group
    for kind, message, alive in _refusals(reports, "prefill_of_a_non_causal_step"):
        assert kind == InvalidInputError.__name__ and "causal steps only" in message
        assert alive == n


def test_ranks_that_disagree_on_decode_or_prefill_context_parallel_all_refuse(
    group: tuple[int, dict[int, Any]],
) -> None:
    n, reports = group
    for kind, message, alive in _refusals(
        reports, "ranks_disagree_on_the_kind_of_context_parallel"
    ):
        assert kind == InvalidInputError.__name__ and "kind differs" in message
        assert alive == n


# --- the harness ---------------------------------------------------------------------------


def die_on_last_rank(rank: int, n: int, job: dict[str, Any]) -> str:
    """The last rank exits without a report (as a crashed rank does); the others return."""
    if rank == n - 1:
        import os

        os._exit(3)
    return "done"


def test_a_rank_that_dies_fails_its_group_without_waiting_for_the_deadline() -> None:
    """The harness notices the dead process (its exit code) instead of waiting for a report
    until the deadline, whose message would be another one."""
    job = dict(backend="torch", spec=None, device="cpu", emulate=False, sub_cases=[],
               extra=f"{__name__}:die_on_last_rank")  # fmt: skip
    with pytest.raises(AssertionError, match=r"rank\(s\) \[1\] of the 2-rank group exited "
                       r"without a report \(exit codes \[3\]\)"):  # fmt: skip
        run_group(2, job, DEADLINE_S)
