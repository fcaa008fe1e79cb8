"""Graph mode: a backend that declares graph support gives, through attnhub's GraphRunner on its
own graph adaptor, what eager forward and the reference give.

For each query length the backend's level captures (1; 2 as well from UNIFORM_BATCH with
multi-token decode), a two-layer model is captured at three sizes and replayed with many batches
that pad to the same descriptors: each with new sequence lengths, block tables and inputs. A
backend that captures any batch (ALWAYS) also replays mixed batches (decodes and longer queries
together) through the runner's mixed descriptors. Every replay is compared with the reference
(per layer, within the declared tolerance) and with an eager twin of the model (ordinary build +
forward), and the caches must hold the same bytes as the twin's. The reference takes the query
as the backend's kernels do (quantized where it declares ``query_quantization`` for the cache)
and allows what a declared probability rounding can change, as the suite's other same-inputs
comparisons do. Each layer runs under the host-sync guard, so capture itself proves forward
reads no device data on the host. A backend that refreshes host-side kernel arguments per step
(``update_graph_params``) must also show that the refresh matters: replaying without it raises
or gives a wrong answer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attnhub import AttentionSpec, BatchMetadata, GraphSupport, reference, testing
from attnhub.backend import AttentionMetadataBuilder
from attnhub.errors import UnsupportedConfigurationError
from attnhub.graphs import GraphRunner
from attnhub_conformance.cases import Case
from attnhub_conformance.graph_cases import query_lens_for
from attnhub_conformance.hostsync import HostSyncError, run_layer_guarded, where

WIDTH = 3  # blocks per request in the runner's persistent block table
MAX_REQS = 8
#: Requests per step: every size of the capture sizes (2, 4, 8 requests) is hit several times.
STEPS = (3, 4, 2, 7, 5, 1, 8, 6, 3)
#: Requests per mixed step (ALWAYS): each count twice, with other query lengths.
MIXED_STEPS = (3, 3, 2, 2, 5, 8, 5, 8)
MIXED_SIZES = (2, 4, 8, 16, 32)  # requests pad to a size, tokens (+ dummies) to a size


class Model:
    """Two layers (own weights, own caches) on one backend; the same seed gives a twin."""

    def __init__(self, case: Case, spec: AttentionSpec) -> None:
        self.spec = spec
        self.backend = case.target.create(spec)
        self.builder = self.backend.metadata_builder()
        g = testing.generator(testing.seed_of(case.id))
        dev = self.backend.device
        self.num_blocks = 1 + MAX_REQS * WIDTH + 2
        self.table = testing.shuffled_block_table(
            [WIDTH * spec.block_size] * MAX_REQS, spec.block_size, self.num_blocks, g
        )
        self.layers: list[tuple[Any, Any, torch.Tensor | None, torch.Tensor | None]] = []
        for _ in range(2):
            slopes = testing.alibi_slopes(spec.num_heads, device=dev) if spec.use_alibi else None
            sinks = testing.random_sinks(spec.num_heads, g, device=dev) if spec.use_sinks else None
            cache = self.backend.allocate_kv_cache(self.num_blocks)
            testing.fill_cache_random(cache, g)
            impl = self.backend.impl(alibi_slopes=slopes, sinks=sinks)
            self.layers.append((impl, cache, slopes, sinks))

    @property
    def caches(self) -> list[Any]:
        return [cache for _, cache, _, _ in self.layers]

    def graph_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> Any:
        """Every layer under the host-sync guard (it runs inside the capture)."""
        outs = []
        for impl, cache, _, _ in self.layers:
            try:
                outs.append(run_layer_guarded(impl, q, k, v, cache, meta))
            except HostSyncError as exc:
                raise HostSyncError(f"inside graph capture: {exc} (at {where(exc)})") from None
        return tuple(outs)

    def eager_step(self, batch: BatchMetadata, q: torch.Tensor, k: Any, v: Any) -> list[Any]:
        meta = self.builder.build(batch)
        return [impl.forward(q, k, v, cache, meta) for impl, cache, _, _ in self.layers]

    def batch(self, num_reqs: int, query_len: int, g: torch.Generator) -> BatchMetadata:
        longest = WIDTH * self.spec.block_size
        seqs = torch.randint(query_len, longest + 1, (num_reqs,), generator=g).tolist()
        return BatchMetadata.from_lengths(
            [query_len] * num_reqs,
            seqs,
            self.table[:num_reqs],
            self.spec.block_size,
            self.backend.device,
        )

    def mixed_batch(self, num_reqs: int, g: torch.Generator) -> BatchMetadata:
        """``num_reqs`` requests (two at least) of 1 to 3 query tokens, not all alike,
        shortest first (decodes before longer queries, as engines order a batch)."""
        longest = WIDTH * self.spec.block_size
        query = torch.randint(1, 4, (num_reqs,), generator=g).sort().values.tolist()
        if len(set(query)) == 1:
            query[-1] = query[0] % 3 + 1
            query.sort()
        seqs = [int(torch.randint(q, longest + 1, (1,), generator=g)) for q in query]
        return BatchMetadata.from_lengths(
            query, seqs, self.table[:num_reqs], self.spec.block_size, self.backend.device
        )

    def runner(self, query_len: int | None) -> GraphRunner:
        """Capture sizes of 2, 4 and 8 requests of ``query_len``; None: mixed batches'."""
        sizes = MIXED_SIZES if query_len is None else [2 * query_len, 4 * query_len, 8 * query_len]
        return GraphRunner(
            self.backend,
            self.graph_step,
            capture_sizes=sizes,
            max_blocks_per_req=WIDTH,
            kv_caches=self.caches,
        )


def _tolerance(model: Model) -> Any:
    dtype = model.spec.dtype
    tol = testing.capped_tolerance(model.backend.capabilities.tolerances[dtype], dtype)
    assert tol is not None, f"the declared tolerance for {dtype} is looser than the suite's cap"
    return tol


def _models(case: Case) -> tuple[Model, Model]:
    assert case.config is not None
    spec = case.config.spec()
    graphed = Model(case, spec)
    if graphed.builder.graph_support == GraphSupport.NEVER:
        batch = graphed.batch(2, 1, testing.generator(0))
        with pytest.raises(UnsupportedConfigurationError):
            graphed.builder.build_for_graph_capture(batch)
        pytest.skip(
            f"{case.id}: the backend's builder captures no graph for this spec (graph_support "
            "NEVER for it; build_for_graph_capture refuses with a reason)"
        )
    twin = Model(case, spec)
    # One eager step on both before any capture, as an engine's warm-up run precedes its
    # captures (and CUDAGraphAdaptor's own warm-up run each one): what a backend checks once
    # per weight on the host (e.g. a static scale's values) is checked there, never inside a
    # capture; every later step still runs its layers under the host-sync guard.
    g = testing.generator(testing.seed_of(case.id) + 2)
    batch = graphed.batch(2, 1, g)
    q, k, v = _inputs(graphed, batch, g)
    for model in (graphed, twin):
        model.eager_step(batch, q, k, v)
    return graphed, twin


def _reference(
    model: Model, layer: int, batch: BatchMetadata, q: torch.Tensor, k: Any, v: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference output of ``layer`` for this step (over its cache after the step's
    write), and what a declared probability rounding may add to the tolerance (or None)."""
    _, cache, slopes, sinks = model.layers[layer]
    spec, caps = model.spec, model.backend.capabilities
    expected = testing.cache_after_write(cache, k, v, batch.slot_mapping)
    query = testing.quantized_query(q, caps, spec.kv_cache_dtype)
    out, _ = reference.paged_attention(
        query, expected, batch, spec, alibi_slopes=slopes, sinks=sinks
    )
    scheme = caps.probability_quantization.get(spec.kv_cache_dtype)
    if scheme is None:
        return out, None
    allowance = testing.probability_allowance(
        query, expected, batch, spec, scheme, alibi_slopes=slopes, sinks=sinks
    )
    return out, allowance


def _inputs(model: Model, batch: BatchMetadata, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    return testing.random_qkv(model.spec, batch.num_tokens, g, device=model.backend.device)


def _replay_and_compare(
    graphed: Model, twin: Model, runner: GraphRunner, batch: BatchMetadata, g: Any, what: str
) -> None:
    """One step through ``runner`` and through the eager twin: every layer's rows within the
    tolerance of the reference and of the twin, the caches byte-equal to the twin's."""
    tol = _tolerance(graphed)
    q, k, v = _inputs(graphed, batch, g)
    expected = [_reference(graphed, i, batch, q, k, v) for i in range(len(graphed.layers))]
    outs = [o.clone() for o in runner.run(batch, q, k, v)]
    eager = twin.eager_step(batch, q, k, v)
    for layer, (out, want, (ref, allow)) in enumerate(zip(outs, eager, expected, strict=True)):
        n = batch.num_actual_tokens
        out_cpu = out.to("cpu")
        why = testing.mismatch(out_cpu, ref, tol, batch, allowance=allow)
        assert why is None, f"{what}, layer {layer} vs reference: {why}"
        testing.assert_within(out_cpu, want[:n].to("cpu"), tol, f"{what}, layer {layer} vs eager")
    for layer, (a, b) in enumerate(zip(graphed.caches, twin.caches, strict=True)):
        for name, plane in a.planes().items():
            assert torch.equal(plane, b.planes()[name]), (
                f"{what}: layer {layer}'s cache {name} differs from the eager twin's"
            )


@pytest.mark.attnhub_cases("graphs")
def test_graph_replays_match_eager_and_the_reference(case: Case) -> None:
    graphed, twin = _models(case)
    caps = graphed.backend.capabilities
    g = testing.generator(testing.seed_of(case.id) + 1)
    for query_len in query_lens_for(graphed.builder.graph_support, caps.multi_token_decode):
        runner = graphed.runner(query_len)
        for i, num_reqs in enumerate(STEPS):
            batch = graphed.batch(num_reqs, query_len, g)
            what = f"{case.id}: query_len {query_len}, step {i} ({num_reqs} requests)"
            _replay_and_compare(graphed, twin, runner, batch, g, what)
        assert runner.stats["replays"] == len(STEPS)
        assert runner.stats["captures"] == len(runner.graphs) == 3, (
            f"{case.id}: {len(STEPS)} steps over capture sizes of 2, 4 and 8 requests should "
            f"capture 3 graphs, captured {runner.stats['captures']}"
        )
    if graphed.builder.graph_support < GraphSupport.ALWAYS:
        return
    runner = graphed.runner(None)
    for i, num_reqs in enumerate(MIXED_STEPS):
        batch = graphed.mixed_batch(num_reqs, g)
        lens = batch.query_lens_cpu.tolist()
        what = f"{case.id}: mixed step {i} (query lengths {lens})"
        _replay_and_compare(graphed, twin, runner, batch, g, what)
    assert runner.stats["replays"] == len(MIXED_STEPS) and not runner.stats["eager"]
    assert runner.stats["captures"] == len(runner.graphs) < len(MIXED_STEPS)
    assert not any(d.uniform_decode for d in runner.graphs), (
        f"{case.id}: mixed steps ran on uniform graphs ({list(runner.graphs)})"
    )


@pytest.mark.attnhub_cases("graphs")
def test_a_replay_needs_the_backends_update(case: Case) -> None:
    graphed, _ = _models(case)
    builder = graphed.builder
    if type(builder).update_graph_params is AttentionMetadataBuilder.update_graph_params:
        pytest.skip(
            f"{case.id}: the backend refreshes no host-side argument per step (its captured "
            "kernels read every per-step value from the persistent device buffers)"
        )
    runner = graphed.runner(1)
    g = testing.generator(3)
    first = graphed.batch(3, 1, g)
    runner.run(first, *_inputs(graphed, first, g))
    grown = BatchMetadata.from_lengths(
        [1] * 3,
        [min(int(s) + 1, WIDTH * graphed.spec.block_size) for s in first.seq_lens_cpu],
        graphed.table[:3],
        graphed.spec.block_size,
        graphed.backend.device,
    )
    q, k, v = _inputs(graphed, grown, g)
    want, allow = _reference(graphed, len(graphed.layers) - 1, grown, q, k, v)
    runner.builder.update_graph_params = lambda *a: None  # type: ignore[method-assign]
    try:
        out = runner.run(grown, q, k, v)[-1].to("cpu")
    except Exception:  # the device would hang or refuse: the update is needed
        return
    why = testing.mismatch(out, want, _tolerance(graphed), grown, allowance=allow)
    assert why is not None, (
        f"{case.id}: a replay with new lengths but no update_graph_params still matched the "
        "reference: then the hook refreshes nothing the graph needs"
    )
