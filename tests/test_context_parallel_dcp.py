"""Decode context parallel through a backend (``attnhub.context_parallel.DecodeContextParallel``)
over real gloo groups: 2 and 4 processes spawned here (``attnhub_conformance.multi_rank``'s
harness: bounded in time, every process reaped on failure), the built-in ``torch`` backend.

Each group runs once per world size (a module fixture); the tests read what each rank reported:
the DCP output of decodes, a multi-token decode and chunked-prefill rows in one step against the
float64 reference and the single-rank run of the same step (the declared float32 tolerance),
each rank's cache against the single-rank cache, no NaN from a rank whose shard of a request is
empty (unused slots seeded with NaN), sinks counted once, and bad input refused with a typed
error on every rank before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from attnhub_conformance.multi_rank import DCP_STEPS, SubCase, run_group, sub_cases

from attnhub import AttentionSpec, BatchMetadata, LseSupport, testing
from attnhub.capabilities import Refusal
from attnhub.context_parallel import (
    AllGatherReduceScatter,
    DecodeContextParallel,
    dcp_unsupported_reasons,
)
from attnhub.errors import InvalidInputError, UnsupportedConfigurationError
from attnhub.testing import generator, num_blocks_for, shuffled_block_table
from attnhub.torch_backend.backend import TorchBackend, TorchMetadataBuilder

BLOCK_SIZE = 4
SPEC = AttentionSpec(
    num_heads=2, num_kv_heads=1, head_size=16, dtype=torch.float32, block_size=BLOCK_SIZE
)
SUB_CASES = sub_cases(BLOCK_SIZE, sinks=True)
WORLD_SIZES = [2, 4]
#: What each group runs: 4 ranks the sinks sub-cases only (each step, interleave and variant
#: once; without sinks the merge differs only by them), to keep the group's time short.
RUN = {2: SUB_CASES, 4: [s for s in SUB_CASES if s.sinks]}


class NoLseTorchBackend(TorchBackend):
    """The torch backend declaring no LSE (what a vendor backend without it declares)."""

    capabilities = replace(
        TorchBackend.capabilities, lse=LseSupport(reason="this test's kernels return none")
    )


class LengthLimitedBuilder(TorchMetadataBuilder):
    """Refuses a step whose longest sequence is over ``9 // N`` tokens (``N``: the default
    group's size): over the bad-input step's shards ([9, 7] tokens) only rank 0's, which holds
    ``ceil(9 / N)`` of request 0, is. A refusal that depends on the rank's own lengths."""

    def build(self, batch: BatchMetadata, *, common_prefix_len: int = 0) -> Any:
        import torch.distributed as dist

        limit = 9 // dist.get_world_size()
        longest = int(batch.seq_lens_cpu.max())
        if longest > limit:
            raise UnsupportedConfigurationError(
                self.backend.name, [f"seq_len {longest} is over this test's limit {limit}"]
            )
        return super().build(batch, common_prefix_len=common_prefix_len)


class LengthLimitedTorchBackend(TorchBackend):
    builder_type = LengthLimitedBuilder


# --- what every rank runs after the DCP sub-cases ----------------------------------------------


def _outcome(call: Any) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


def bad_inputs(rank: int, n: int, job: dict[str, Any]) -> dict[str, tuple[str, str, int]]:
    """Bad input, one case after another on every rank; after each, one all-reduce shows the
    group still in step (no rank left waiting in a collective)."""
    import torch.distributed as dist

    comm = AllGatherReduceScatter()
    g = generator(7)
    virtual = n * BLOCK_SIZE
    seq_lens = [9, 7]
    table = shuffled_block_table(seq_lens, virtual, num_blocks_for(seq_lens, virtual), g)
    batch = BatchMetadata.from_lengths([1, 3], seq_lens, table, virtual)
    other = BatchMetadata.from_lengths([1, 3], [10, 7], table, virtual)
    torch_backend = TorchBackend(SPEC)

    def plan(spec: AttentionSpec = SPEC, backend: type[Any] = TorchBackend, **kw: Any) -> Any:
        given = dict(world_size=n, interleave=1, batch=batch) | kw
        dcp = DecodeContextParallel(
            backend(spec), comm, world_size=given["world_size"], interleave=given["interleave"]
        )
        return dcp.plan(given["batch"])

    cases = {
        "interleave_not_dividing_block_size": lambda: plan(interleave=3),
        "ranks_disagree_on_the_step": lambda: plan(batch=other if rank == 0 else batch),
        "wrong_group_size": lambda: plan(world_size=n + 1),
        "sliding_window": lambda: plan(replace(SPEC, sliding_window=8)),
        "alibi": lambda: plan(replace(SPEC, use_alibi=True)),
        "no_lse_declared": lambda: plan(backend=NoLseTorchBackend),
        "one_rank_refuses_its_spec": lambda: plan(
            replace(SPEC, sliding_window=8) if rank == 0 else SPEC
        ),
        "ranks_with_other_head_counts": lambda: plan(
            replace(SPEC, num_heads=1) if rank == 0 else SPEC
        ),
        "ranks_with_another_dtype": lambda: plan(
            replace(SPEC, dtype=torch.bfloat16) if rank == n - 1 else SPEC
        ),
        "a_build_failing_on_one_rank_only": lambda: plan(backend=LengthLimitedTorchBackend),
        "an_impl_of_another_spec": lambda: DecodeContextParallel(
            torch_backend, comm, world_size=n
        ).forward(
            TorchBackend(replace(SPEC, num_heads=1)).impl(),
            plan(),
            torch.zeros(4, 1, 16),
            torch.zeros(4, 1, 16),
            torch.zeros(4, 1, 16),
            torch_backend.allocate_kv_cache(4),
        ),
    }
    found = {}
    for name, call in cases.items():
        kind, message = _outcome(call)
        alive = torch.ones(1)
        dist.all_reduce(alive)
        found[name] = (kind, message, int(alive.item()))
    return found


def non_causal_step(rank: int, n: int) -> dict[str, Any]:
    """A step that is not causal (``batch.causal`` False: every row sees every key of its
    request, as the single-rank backend and the reference take it): a multi-token decode and a
    chunked prefill over their context, and a first prefill, through DCP (interleave 1, sinks)
    against the float64 reference of the whole step. What this rank found."""
    from attnhub import reference
    from attnhub.context_parallel import local_slot_mapping

    g = generator(11)
    virtual, hl = n * BLOCK_SIZE, SPEC.num_heads
    query_lens, seq_lens = [3, 5, 4], [n * BLOCK_SIZE + 3, 2 * n * BLOCK_SIZE + 1, 4]
    table = shuffled_block_table(seq_lens, virtual, num_blocks_for(seq_lens, virtual), g)
    batch = BatchMetadata.from_lengths(query_lens, seq_lens, table, virtual, causal=False)
    keys, values = ([torch.randn(s, 1, 16, generator=g) for s in seq_lens] for _ in range(2))
    query = torch.randn(sum(query_lens), n * hl, 16, generator=g)
    sinks = torch.randn(n * hl, generator=g)
    heads = slice(rank * hl, (rank + 1) * hl)
    spec = replace(SPEC, use_sinks=True)
    backend = TorchBackend(spec)
    impl = backend.impl(sinks=sinks[heads])
    cache = backend.allocate_kv_cache(num_blocks_for(seq_lens, virtual))
    for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        pos = torch.arange(s - q)
        slots = local_slot_mapping(pos, torch.full_like(pos, r), table, BLOCK_SIZE, n, rank)
        impl.write_kv(keys[r][: s - q], values[r][: s - q], cache, torch.from_numpy(slots))
    dcp = DecodeContextParallel(backend, AllGatherReduceScatter(), world_size=n)

    def new(planes: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([p[s - q :] for p, q, s in zip(planes, query_lens, seq_lens, strict=True)])

    out = dcp.forward(impl, dcp.plan(batch), query[:, heads], new(keys), new(values), cache)
    # the reference over one cache of every token (blocks 0.. in order), every head
    one = replace(spec, num_heads=n * hl)
    single = TorchBackend(one)
    whole = single.allocate_kv_cache(sum(-(-s // BLOCK_SIZE) for s in seq_lens))
    s_table = torch.zeros(len(seq_lens), max(seq_lens) // BLOCK_SIZE + 1, dtype=torch.int32)
    nxt = 0
    for r, s in enumerate(seq_lens):
        blocks = -(-s // BLOCK_SIZE)
        s_table[r, :blocks] = torch.arange(nxt, nxt + blocks)
        nxt += blocks
        pos = torch.arange(s)
        slots = s_table[r, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        single.impl(sinks=sinks).write_kv(keys[r], values[r], whole, slots)
    s_batch = BatchMetadata.from_lengths(query_lens, seq_lens, s_table, BLOCK_SIZE, causal=False)
    ref, _ = reference.paged_attention(query, whole, s_batch, one, sinks=sinks)
    tol = TorchBackend.capabilities.tolerances[torch.float32]
    return {"mismatch": testing.mismatch(out, ref[:, heads], tol)}


def short_query(n: int) -> tuple[str, str, bool]:
    """A query of the step's real tokens only (its padding rows left out): the outcome, and
    whether the rank's cache is byte-identical to before the call."""
    g = generator(5)
    virtual = n * BLOCK_SIZE
    seq_lens = [9, 7]
    table = shuffled_block_table(seq_lens, virtual, num_blocks_for(seq_lens, virtual), g)
    batch = BatchMetadata.from_lengths([1, 3], seq_lens, table, virtual, num_tokens=6)
    backend = TorchBackend(SPEC)
    dcp = DecodeContextParallel(backend, AllGatherReduceScatter(), world_size=n)
    cache = backend.allocate_kv_cache(num_blocks_for(seq_lens, virtual))
    step = dcp.plan(batch)
    with cache.edit() as plain:
        before = (plain.key.clone(), plain.value.clone())
    key, value = (torch.randn(6, 1, 16, generator=g) for _ in range(2))
    query = torch.randn(4, SPEC.num_heads, 16, generator=g)
    kind, message = _outcome(lambda: dcp.forward(backend.impl(), step, query, key, value, cache))
    with cache.edit() as plain:
        untouched = torch.equal(plain.key, before[0]) and torch.equal(plain.value, before[1])
    return kind, message, untouched


def rank_extras(rank: int, n: int, job: dict[str, Any]) -> dict[str, Any]:
    """What every rank runs after the DCP sub-cases: the bad inputs, a step that is not
    causal, a query without the step's padding rows."""
    return bad_inputs(rank, n, job) | {
        "non_causal_step": non_causal_step(rank, n),
        "short_query": short_query(n),
    }


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"N{n}")
def group(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
    n: int = request.param
    job = dict(
        backend="torch",
        spec=SPEC,
        device="cpu",
        emulate=False,
        sub_cases=RUN[n],
        per_rank_sinks=True,
        extra=f"{__name__}:rank_extras",
    )
    return n, run_group(n, job)


# --- the specification -------------------------------------------------------------------------


@pytest.mark.parametrize("sub", SUB_CASES, ids=lambda s: s.id)
def test_dcp_equals_the_single_rank_step_and_each_cache_holds_its_shard(
    group: tuple[int, dict[int, Any]], sub: SubCase
) -> None:
    n, reports = group
    if sub not in RUN[n]:
        pytest.skip(f"{n} ranks run the sinks sub-cases only")
    for rank, report in reports.items():
        found = report[sub.id]
        assert found["errors"] == [], (rank, found["errors"])
        assert found["seeded_nan"], "the torch backend needs no finite stale slots"
    # the ranks' shards partition every request
    local = [reports[r][sub.id]["local_seq_lens"] for r in range(n)]
    _, seq_lens = DCP_STEPS[sub.step](BLOCK_SIZE, n)
    assert [sum(col) for col in zip(*local, strict=True)] == seq_lens


def test_a_rank_whose_shard_of_a_request_is_empty_contributes_no_nan(
    group: tuple[int, dict[int, Any]],
) -> None:
    """The decode step's one-token request is on rank 0 only: every other rank's shard of it
    is empty, its slots NaN, its dummy key NaN; the output is still the reference's (above)."""
    n, reports = group
    for sub in RUN[n]:
        if sub.step == "decode":
            assert all(reports[r][sub.id]["local_seq_lens"][2] == 0 for r in range(1, n))
            assert all(reports[r][sub.id]["errors"] == [] for r in range(n))


def test_sinks_enter_once_a_merge_adding_them_per_rank_is_caught(
    group: tuple[int, dict[int, Any]],
) -> None:
    """The sinks sub-cases pass (above); the same step with the sinks in every rank's kernel
    instead of once in the merge is off by far more than the tolerance the check uses."""
    _, reports = group
    tol = TorchBackend.capabilities.tolerances[torch.float32]
    n = len(reports)
    for report in reports.values():
        for sub in RUN[n]:
            if sub.sinks:
                assert report[sub.id]["per_rank_sinks_error"] > 100 * tol.atol, report[sub.id]


def test_a_step_that_is_not_causal_sees_every_key_of_its_requests(
    group: tuple[int, dict[int, Any]],
) -> None:
    """``batch.causal`` False: each row attends over every key of its request on every rank
    (not only those up to its own position), as the single-rank step does."""
    _, reports = group
    for rank, report in reports.items():
        assert report["extra"]["non_causal_step"]["mismatch"] is None, rank


def test_a_query_of_other_rows_than_the_step_is_refused_before_the_kv_write(
    group: tuple[int, dict[int, Any]],
) -> None:
    """Every rank refuses it (the check is local: the same on every rank of an agreed step),
    its cache untouched: not found only in the merge, after the new keys were written."""
    _, reports = group
    for rank, report in reports.items():
        kind, message, untouched = report["extra"]["short_query"]
        assert kind == InvalidInputError.__name__, (rank, message)
        assert "query has 4 rows, the step 6" in message, (rank, message)
        assert untouched, rank


def _refusals(reports: dict[int, Any], name: str) -> list[tuple[str, str, int]]:
    return [reports[r]["extra"][name] for r in sorted(reports)]


NOT_DIVIDING = f"interleave = 3 does not divide block_size = {BLOCK_SIZE}"


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("interleave_not_dividing_block_size", NOT_DIVIDING),
        ("ranks_disagree_on_the_step", "seq_lens differs"),
        ("wrong_group_size", "but the context-parallel process group has"),
    ],
)
def test_bad_input_is_refused_on_every_rank_before_any_collective(
    group: tuple[int, dict[int, Any]], name: str, words: str
) -> None:
    n, reports = group
    for kind, message, alive in _refusals(reports, name):
        assert kind == InvalidInputError.__name__, message
        assert words in message
        assert alive == n


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("sliding_window", "sliding window"),
        ("alibi", "ALiBi needs each key's global position"),
        ("no_lse_declared", "this test's kernels return none"),
    ],
)
def test_what_a_shard_cannot_serve_is_refused_with_the_reason_on_every_rank(
    group: tuple[int, dict[int, Any]], name: str, words: str
) -> None:
    n, reports = group
    for kind, message, alive in _refusals(reports, name):
        assert kind == UnsupportedConfigurationError.__name__, message
        assert words in message and "decode context parallel" in message
        assert alive == n


def test_a_spec_refused_on_one_rank_only_stops_every_rank(
    group: tuple[int, dict[int, Any]],
) -> None:
    n, reports = group
    refusals = _refusals(reports, "one_rank_refuses_its_spec")
    assert refusals[0][0] == UnsupportedConfigurationError.__name__
    assert "sliding window" in refusals[0][1]
    assert all(kind == InvalidInputError.__name__ for kind, _, _ in refusals[1:])
    assert all("rank(s) [0]" in message for _, message, _ in refusals[1:])
    assert all(alive == n for _, _, alive in refusals)


def test_ranks_whose_layers_have_other_head_counts_all_refuse_the_step(
    group: tuple[int, dict[int, Any]],
) -> None:
    """Their gathered queries and merged heads would differ in shape: the step's agreement
    carries the layer's spec."""
    n, reports = group
    shown = ", ".join(f"rank {r}: {1 if r == 0 else SPEC.num_heads}" for r in range(n))
    for kind, message, alive in _refusals(reports, "ranks_with_other_head_counts"):
        assert kind == InvalidInputError.__name__, message
        assert f"spec.num_heads differs between ranks ({shown})" in message
        assert alive == n


def test_ranks_whose_layers_have_another_dtype_all_refuse_the_step(
    group: tuple[int, dict[int, Any]],
) -> None:
    n, reports = group
    refusals = _refusals(reports, "ranks_with_another_dtype")
    for kind, message, alive in refusals:
        assert kind == InvalidInputError.__name__, message
        assert "spec.dtype differs between ranks" in message and f"ranks [{n - 1}]" in message
        assert alive == n
    assert "this rank's: torch.bfloat16" in refusals[n - 1][1]
    assert "this rank's: torch.float32" in refusals[0][1]


def test_a_metadata_build_failing_on_one_rank_only_stops_every_rank(
    group: tuple[int, dict[int, Any]],
) -> None:
    """The ranks agree on the step; then rank 0's build over its own (longer) shard refuses:
    every rank raises before the layer's collectives, the others naming rank 0's reason."""
    n, reports = group
    refusals = _refusals(reports, "a_build_failing_on_one_rank_only")
    limit = f"over this test's limit {9 // n}"
    assert refusals[0][0] == UnsupportedConfigurationError.__name__
    assert limit in refusals[0][1]
    for kind, message, _ in refusals[1:]:
        assert kind == InvalidInputError.__name__, message
        assert "metadata build failed on rank(s) [0]" in message and limit in message
    assert all(alive == n for _, _, alive in refusals)


def test_a_layer_of_another_spec_is_refused(group: tuple[int, dict[int, Any]]) -> None:
    n, reports = group
    for kind, message, alive in _refusals(reports, "an_impl_of_another_spec"):
        assert kind == InvalidInputError.__name__ and "another spec" in message
        assert alive == n


# --- without processes -----------------------------------------------------------------------


@dataclass(frozen=True)
class LseWithoutSinks(LseSupport):
    """An LSE declared for every dtype but not with sinks (a kernel that does not count them)."""

    def refusal(self, spec: AttentionSpec) -> Refusal | None:
        if spec.use_sinks:
            return Refusal("return_lse: not with sinks", field="lse", value="sinks")
        return super().refusal(spec)


class LseWithoutSinksBackend(TorchBackend):
    capabilities = replace(
        TorchBackend.capabilities,
        lse=LseWithoutSinks(dtypes=TorchBackend.capabilities.lse.dtypes),
    )


def test_an_lse_declared_without_sinks_serves_a_layer_with_sinks() -> None:
    """The kernel runs without the sinks (the merge adds them once), so only the LSE of a
    sink-free spec is needed."""
    with_sinks = replace(SPEC, use_sinks=True)
    assert LseWithoutSinksBackend.capabilities.lse.refusal(with_sinks) is not None
    assert dcp_unsupported_reasons(LseWithoutSinksBackend, with_sinks) == []


def test_the_reasons_name_what_a_shard_cannot_serve() -> None:
    spec = replace(SPEC, sliding_window=8, use_alibi=True, logits_soft_cap=30.0)
    fields = [r.field for r in dcp_unsupported_reasons(TorchBackend, spec)]
    assert fields == ["sliding_window", "alibi"]  # softcap is per score: served
    fields = [r.field for r in dcp_unsupported_reasons(NoLseTorchBackend, SPEC)]
    assert fields == ["lse"]
