"""Decode context parallel of MLA layers (the absorbed form) through
``attnhub.context_parallel.DecodeContextParallel`` over real gloo groups: 2 and 4 processes
spawned here (``attnhub_conformance.multi_rank``'s harness: bounded, reaped on failure), the
built-in ``torch`` backend and the emulated ``ascend`` backend (its LSE route: ATB's
``npu_multi_head_latent_attention``).

Each rank keeps its shard of the latent cache (no kv heads: every rank holds the latents of its
tokens), gathers the group's query heads, makes its MLA call with the LSE and merges by it. The
tests read what each rank reported: the latent output of decodes, a multi-token decode and
chunked-prefill rows in one step against ``reference.paged_mla_absorbed`` and the single-rank MLA
run of the same step (the declared tolerance), each rank's latent cache against the single-rank
one, no NaN from a rank whose shard of a request is empty (unused slots seeded with NaN), and
bad input refused with a typed error on every rank, the group still in step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from attnhub_conformance.multi_rank import DCP_STEPS, SubCase, run_group, sub_cases

from attnhub import AttentionSpec, BatchMetadata, LseSupport
from attnhub.context_parallel import (
    AllGatherReduceScatter,
    DcpGraphRunner,
    DecodeContextParallel,
    dcp_unsupported_reasons,
)
from attnhub.errors import InvalidInputError, UnsupportedConfigurationError
from attnhub.mla import MLASpec
from attnhub.testing import generator, num_blocks_for, shuffled_block_table
from attnhub.torch_backend.backend import TorchBackend

TORCH_SPEC = MLASpec(
    num_heads=2, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    dtype=torch.float32, block_size=4,
)  # fmt: skip
#: What the ascend backend's MLA form takes: the DeepSeek latent, 32 heads per rank (the
#: gathered 64 or 128 are FIA's head counts too), blocks of 16.
ASCEND_SPEC = MLASpec(
    num_heads=32, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    dtype=torch.float16, block_size=16,
)  # fmt: skip
SPECS = {"torch": TORCH_SPEC, "ascend": ASCEND_SPEC}
GROUPS = [("torch", 2), ("torch", 4), ("ascend", 2), ("ascend", 4)]


class NoMlaLseTorchBackend(TorchBackend):
    """The torch backend declaring no MLA LSE (what a vendor backend without it declares)."""

    capabilities = replace(
        TorchBackend.capabilities,
        mla=replace(
            TorchBackend.capabilities.mla,
            lse=LseSupport(reason="this test's MLA kernels return none"),
        ),
    )


class TwoHeadMlaTorchBackend(TorchBackend):
    """MLA kernels built for 2 query heads only: the rank's layer is served, the gathered
    one (``N * 2`` heads) is not."""

    capabilities = replace(
        TorchBackend.capabilities,
        mla=replace(
            TorchBackend.capabilities.mla,
            num_heads=frozenset({2}),
            because={"mla.num_heads": "this test's kernels tile 2 heads"},
        ),
    )


def _outcome(call: Any) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


def bad_inputs(rank: int, n: int, job: dict[str, Any]) -> dict[str, tuple[str, str, int, bool]]:
    """Bad input, one case after another on every rank; after each, one all-reduce shows the
    group still in step (no rank left waiting in a collective), and whether the rank's latent
    cache is byte-identical to before the case."""
    import torch.distributed as dist

    spec = TORCH_SPEC
    comm = AllGatherReduceScatter()
    g = generator(7)
    virtual = n * spec.block_size
    seq_lens = [9, 7]
    table = shuffled_block_table(seq_lens, virtual, num_blocks_for(seq_lens, virtual), g)
    batch = BatchMetadata.from_lengths([1, 3], seq_lens, table, virtual)
    other = BatchMetadata.from_lengths([1, 3], [10, 7], table, virtual)
    backend = TorchBackend(spec)
    cache = backend.allocate_kv_cache(table.numel() + 1)
    cache.kv_c.copy_(torch.randn(cache.kv_c.shape, generator=g))
    cache.k_pe.copy_(torch.randn(cache.k_pe.shape, generator=g))

    def plan(
        layer: MLASpec | AttentionSpec = spec, cls: type[Any] = TorchBackend, **kw: Any
    ) -> Any:
        given = dict(world_size=n, interleave=1, batch=batch) | kw
        dcp = DecodeContextParallel(
            cls(layer), comm, world_size=given["world_size"], interleave=given["interleave"]
        )
        return dcp.plan(given["batch"])

    def forward(query: torch.Tensor, kv_c: Any, k_pe: Any) -> Any:
        dcp = DecodeContextParallel(backend, comm, world_size=n)
        return dcp.forward(backend.impl(), dcp.plan(batch), query, kv_c, k_pe, cache)

    def captured(query: torch.Tensor) -> Any:
        dcp = DecodeContextParallel(backend, comm, world_size=n)
        runner = DcpGraphRunner(
            dcp, lambda *a: a[0], capture_sizes=[4], max_blocks_per_req=2, kv_caches=[cache]
        )
        return runner.run(batch, query, latent, rope)

    t, hl = 4, spec.num_heads
    latent = torch.zeros(t, spec.kv_lora_rank)
    rope = torch.zeros(t, spec.qk_rope_head_dim)
    standard = AttentionSpec(
        num_heads=hl, num_kv_heads=1, head_size=spec.latent_size, dtype=spec.dtype,
        block_size=spec.block_size,
    )  # fmt: skip
    cases = {
        "interleave_not_dividing_block_size": lambda: plan(interleave=3),
        "ranks_disagree_on_the_step": lambda: plan(batch=other if rank == 0 else batch),
        "wrong_group_size": lambda: plan(world_size=n + 1),
        "no_mla_lse_declared": lambda: plan(cls=NoMlaLseTorchBackend),
        "gathered_spec_refused": lambda: plan(cls=TwoHeadMlaTorchBackend),
        "ranks_with_another_latent": lambda: plan(
            replace(spec, kv_lora_rank=16) if rank == 0 else spec
        ),
        "ranks_with_other_mla_widths": lambda: plan(
            replace(spec, qk_nope_head_dim=8, scale=spec.scale) if rank == n - 1 else spec
        ),
        "an_mla_rank_and_a_standard_rank": lambda: plan(standard if rank == 0 else spec),
        "query_of_the_expanded_width": lambda: forward(
            torch.zeros(t, hl, spec.qk_head_dim), latent, rope
        ),
        "rope_part_missing": lambda: forward(torch.zeros(t, hl, spec.latent_size), latent, None),
        "captured_mla_steps": lambda: captured(torch.zeros(t, hl, spec.latent_size)),
        # not bad input: nothing new to write (vLLM writes latents apart), the cache untouched
        "nothing_new_to_write": lambda: forward(torch.zeros(t, hl, spec.latent_size), None, None),
        "latent_too_wide": lambda: forward(
            torch.zeros(t, hl, spec.latent_size), torch.zeros(t, spec.kv_lora_rank + 1), rope
        ),
    }
    found = {}
    for name, call in cases.items():
        before = cache.clone()
        kind, message = _outcome(call)
        alive = torch.ones(1)
        dist.all_reduce(alive)
        found[name] = (kind, message, int(alive.item()), cache.equal(before))
    return found


def ascend_refusals(rank: int, n: int, job: dict[str, Any]) -> dict[str, tuple[str, str, int]]:
    """What the ascend backend refuses of an MLA DCP layer beyond the MLA LSE's declaration:
    a scale ATB's op does not take (the impl's own LSE refusal), and a gathered head count
    FIA's MLA form does not take (128 per rank, served alone: 256 or 512 gathered)."""
    import torch.distributed as dist
    from attnhub_ascend import AscendBackend

    g = generator(9)
    spec = ASCEND_SPEC
    virtual = n * spec.block_size
    table = shuffled_block_table([20], virtual, num_blocks_for([20], virtual), g)
    batch = BatchMetadata.from_lengths([1], [20], table, virtual)

    def plan(layer: MLASpec) -> Any:
        backend = AscendBackend(layer, "cpu", emulate=True)
        return DecodeContextParallel(backend, AllGatherReduceScatter(), world_size=n).plan(batch)

    cases = {
        "scale_outside_atb": lambda: plan(replace(spec, scale=2.0)),
        "gathered_heads_not_fia": lambda: plan(replace(spec, num_heads=128)),
    }
    found = {}
    for name, call in cases.items():
        kind, message = _outcome(call)
        alive = torch.ones(1)
        dist.all_reduce(alive)
        found[name] = (kind, message, int(alive.item()))
    return found


@pytest.fixture(scope="module", params=GROUPS, ids=lambda p: f"{p[0]}-N{p[1]}")
def group(request: pytest.FixtureRequest) -> tuple[str, int, dict[int, Any]]:
    name, n = request.param
    spec = SPECS[name]
    job = dict(
        backend=name,
        spec=spec,
        device="cpu",
        emulate=name != "torch",
        sub_cases=sub_cases(spec.block_size, sinks=False),
        extra=f"{__name__}:{'bad_inputs' if name == 'torch' else 'ascend_refusals'}",
    )
    return name, n, run_group(n, job)


@pytest.mark.parametrize("sub", sub_cases(4, sinks=False), ids=lambda s: s.id)
def test_mla_dcp_equals_the_single_rank_mla_step_and_each_latent_cache_holds_its_shard(
    group: tuple[str, int, dict[int, Any]], sub: SubCase
) -> None:
    name, n, reports = group
    block = SPECS[name].block_size
    sub = replace(sub, interleave=block if sub.interleave != 1 else 1)
    for rank, report in reports.items():
        found = report[sub.id]
        assert found["errors"] == [], (name, rank, found["errors"])
        assert found["seeded_nan"], "neither backend needs finite stale slots"
        assert found["single_rank"], "both backends serve the step's query lengths"
    local = [reports[r][sub.id]["local_seq_lens"] for r in range(n)]
    _, seq_lens = DCP_STEPS[sub.step](block, n)
    assert [sum(col) for col in zip(*local, strict=True)] == seq_lens


def test_a_rank_whose_latent_shard_of_a_request_is_empty_contributes_no_nan(
    group: tuple[str, int, dict[int, Any]],
) -> None:
    """The decode step's one-token request is on rank 0 only: every other rank's shard of it
    is empty, its latent slots NaN, its dummy key NaN; the output is still the reference's."""
    name, n, reports = group
    for sub in sub_cases(SPECS[name].block_size, sinks=False):
        if sub.step == "decode":
            assert all(reports[r][sub.id]["local_seq_lens"][2] == 0 for r in range(1, n))
            assert all(reports[r][sub.id]["errors"] == [] for r in range(n))


def _refusals(group: tuple[str, int, dict[int, Any]], case: str) -> list[Any]:
    name, _, reports = group
    if name != "torch":
        pytest.skip("the bad-input cases run on the torch groups")
    return [reports[r]["extra"][case] for r in sorted(reports)]


@pytest.mark.parametrize(
    ("case", "kind", "words"),
    [
        ("interleave_not_dividing_block_size", InvalidInputError, "interleave = 3 does not"),
        ("ranks_disagree_on_the_step", InvalidInputError, "seq_lens differs"),
        ("wrong_group_size", InvalidInputError, "but the context-parallel process group has"),
        ("no_mla_lse_declared", UnsupportedConfigurationError, "this test's MLA kernels return"),
        ("gathered_spec_refused", UnsupportedConfigurationError, "tile 2 heads"),
        ("ranks_with_another_latent", InvalidInputError, "spec.head_size differs between ranks"),
        ("ranks_with_other_mla_widths", InvalidInputError, "spec.mla differs between ranks"),
        ("an_mla_rank_and_a_standard_rank", InvalidInputError, "differs between ranks"),
        ("query_of_the_expanded_width", InvalidInputError, "query must be [num_tokens, 2, 40]"),
        ("rope_part_missing", InvalidInputError, "both given or both None"),
        ("latent_too_wide", InvalidInputError, "kv_c"),
        ("captured_mla_steps", UnsupportedConfigurationError, "captures no one-token decodes"),
    ],
)
def test_bad_mla_input_is_a_typed_error_on_every_rank_the_cache_untouched(
    group: tuple[str, int, dict[int, Any]], case: str, kind: type, words: str
) -> None:
    n = group[1]
    for found_kind, message, alive, untouched in _refusals(group, case):
        assert found_kind == kind.__name__, message
        assert words in message
        assert alive == n and untouched


def test_a_step_with_nothing_new_to_write_leaves_the_latent_cache_as_it_was(
    group: tuple[str, int, dict[int, Any]],
) -> None:
    """kv_c and k_pe both None (vLLM writes the latents apart, ``do_kv_cache_update``)."""
    n = group[1]
    for kind, message, alive, untouched in _refusals(group, "nothing_new_to_write"):
        assert kind == "no error", message
        assert alive == n and untouched


def test_ranks_with_other_mla_widths_name_this_ranks_value(
    group: tuple[str, int, dict[int, Any]],
) -> None:
    refusals = _refusals(group, "ranks_with_other_mla_widths")
    assert "this rank's: (8, 8, 16)" in refusals[-1][1]
    assert "this rank's: (8, 16, 16)" in refusals[0][1]


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("scale_outside_atb", "qk_scale in (0, 1]"),
        ("gathered_heads_not_fia", "FIA's MLA form takes query N 32, 64 or 128"),
    ],
)
def test_what_ascend_cannot_serve_is_refused_with_its_reason_on_every_rank(
    group: tuple[str, int, dict[int, Any]], case: str, words: str
) -> None:
    name, n, reports = group
    if name != "ascend":
        pytest.skip("the ascend groups run these")
    for rank in range(n):
        kind, message, alive = reports[rank]["extra"][case]
        assert kind == UnsupportedConfigurationError.__name__, message
        assert words in message and "decode context parallel" in message
        assert alive == n


# --- without processes -----------------------------------------------------------------------


def test_the_mla_reasons_are_the_declared_mla_lse() -> None:
    assert dcp_unsupported_reasons(TorchBackend, TORCH_SPEC) == []
    (reason,) = dcp_unsupported_reasons(NoMlaLseTorchBackend, TORCH_SPEC)
    assert reason.field == "mla.lse" and "this test's MLA kernels return none" in reason.sentence
    # the standard layer's LSE is another declaration
    assert NoMlaLseTorchBackend.capabilities.lse.refusal(replace(
        AttentionSpec(num_heads=2, num_kv_heads=1, head_size=16, dtype=torch.float32)
    )) is None  # fmt: skip


def test_the_torch_mla_call_reads_no_nan_from_slots_no_row_sees() -> None:
    """A latent cache's unwritten slots may hold NaN (``torch.empty``; a DCP test seeds them):
    the torch MLA call must not carry one into a row through a key it masks (its weight is 0,
    but 0 * NaN is NaN). Regression: the masked keys' latents entered ``P @ kv_c``."""
    from attnhub import reference

    spec = TORCH_SPEC
    backend = TorchBackend(spec)
    g = generator(3)
    seq_lens, query_lens = [6, 1, 9], [1, 1, 2]
    table = shuffled_block_table(seq_lens, spec.block_size, 8, g)
    batch = BatchMetadata.from_lengths(query_lens, seq_lens, table, spec.block_size)
    cache = backend.allocate_kv_cache(8)
    cache.kv_c.fill_(float("nan"))
    cache.k_pe.fill_(float("nan"))
    impl = backend.impl()
    for r, s in enumerate(seq_lens):
        pos = torch.arange(s)
        slots = table[r, pos // spec.block_size].long() * spec.block_size + pos % spec.block_size
        impl.write_kv(torch.randn(s, spec.kv_lora_rank, generator=g),
                      torch.randn(s, spec.qk_rope_head_dim, generator=g), cache, slots)  # fmt: skip
    query = torch.randn(sum(query_lens), spec.num_heads, spec.latent_size, generator=g)
    meta = backend.metadata_builder().build(batch)
    out, lse = impl.forward(query, None, None, cache, meta, return_lse=True)
    want, want_lse = reference.paged_mla_absorbed(query, cache, batch, spec)
    tol = TorchBackend.capabilities.tolerances[torch.float32]
    from attnhub.testing import mismatch

    assert mismatch(out, want, tol) is None
    assert mismatch(lse, want_lse.t(), tol) is None
