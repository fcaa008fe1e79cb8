"""Graph capture of the flash backend: each provider at the level vLLM's own FlashAttention
backend declares for its kernels, on attnhub's eager tape (the emulated kernels are recorded
as one launch each, their host arguments frozen at capture as a CUDA graph freezes them).

Shown here: a graph's ``max_seqlen_k`` is the block table's capacity, so a replay with longer
sequences than the capture step's is right (a graph baking the step's own maximum is refused
by the kernel on that replay); vllm-fa3's schedule is planned again before every replay and a
replay without it is refused; ALWAYS providers replay mixed batches captured once; uniform-only
providers refuse to capture a mixed batch. The conformance suite's graph cases run every
provider through ``GraphRunner`` too.
"""

from __future__ import annotations

from typing import Any

import flash_helpers as h
import pytest
import torch
from attnhub_flash import CAPABILITIES, emulator
from attnhub_flash.emulator import FlashOpError

from attnhub import BatchMetadata, GraphSupport, testing
from attnhub.errors import UnsupportedConfigurationError
from attnhub.graphs import EagerAdaptor, GraphRunner
from attnhub.graphs.buffers import PersistentBatch
from attnhub.graphs.padding import PaddedStep

WIDTH = 4  # blocks per request in the persistent table
SCHEDULE = "vllm.vllm_flash_attn.get_scheduler_metadata"
LEVELS = {
    "vllm": GraphSupport.UNIFORM_BATCH,
    "vllm-fa3": GraphSupport.ALWAYS,
    "vllm-flashmla": GraphSupport.ALWAYS,  # its standard attention is vllm-fa3's
    "fa2": GraphSupport.UNIFORM_BATCH,
    "fa3": GraphSupport.ALWAYS,
    "fa4": GraphSupport.UNIFORM_BATCH,
}


class Model:
    """One layer over a cache of random context, and its step function."""

    def __init__(self, provider: str, seed: int = 0, **changes: Any) -> None:
        self.spec = h.spec(provider, **changes)
        self.backend = h.backend(provider, self.spec)
        self.builder = self.backend.metadata_builder()
        self.g = testing.generator(seed)
        bs = self.spec.block_size
        self.num_blocks = 1 + 8 * WIDTH
        self.table = testing.shuffled_block_table([WIDTH * bs] * 8, bs, self.num_blocks, self.g)
        self.cache = self.backend.allocate_kv_cache(self.num_blocks)
        testing.fill_cache_random(self.cache, self.g)
        self.impl = self.backend.impl()

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> Any:
        return self.impl.forward(q, k, v, self.cache, meta)

    def batch(self, query_lens: list[int], seq_lens: list[int]) -> BatchMetadata:
        n = len(query_lens)
        return BatchMetadata.from_lengths(
            query_lens, seq_lens, self.table[:n], self.spec.block_size
        )

    def inputs(self, batch: BatchMetadata) -> tuple[torch.Tensor, ...]:
        return testing.random_qkv(self.spec, batch.num_tokens, self.g)

    def reference(self, batch: BatchMetadata, q: Any, k: Any, v: Any) -> torch.Tensor:
        return testing.reference_after_write(self.spec, self.cache, batch, q, k, v)[1]

    def check(self, out: torch.Tensor, want: torch.Tensor, what: str) -> None:
        tol = self.backend.capabilities.tolerance(self.spec.dtype)
        testing.assert_within(out, want, tol, f"{self.backend.provider}: {what}")


@pytest.mark.parametrize("provider", h.PROVIDERS)
def test_each_provider_declares_vllms_level_with_its_reason(provider: str) -> None:
    caps = CAPABILITIES[provider]
    assert caps.graph_capture == LEVELS[provider]
    assert caps.graph_capture_reason and "vLLM" in caps.graph_capture_reason
    assert caps.summary()["graph_capture_reason"] == caps.graph_capture_reason


@pytest.mark.parametrize("provider", h.PROVIDERS)
def test_a_replay_longer_than_the_capture_step_is_right(provider: str) -> None:
    """Captured with short sequences, replayed with sequences up to the table's capacity: the
    graph's max_seqlen_k is the capacity (vLLM captures with the max model length)."""
    m = Model(provider)
    bs = m.spec.block_size
    runner = GraphRunner(
        m.backend, m.step, capture_sizes=[4], max_blocks_per_req=WIDTH, kv_caches=[m.cache]
    )
    for seqs in ([2, 3, 1, 2], [WIDTH * bs, bs + 1, 7, WIDTH * bs - 1], [5, 9, 3, 2 * bs]):
        batch = m.batch([1] * 4, seqs)
        q, k, v = m.inputs(batch)
        want = m.reference(batch, q, k, v)
        m.check(runner.run(batch, q, k, v), want, f"replay with seq_lens {seqs}")
    assert runner.stats["captures"] == 1 and runner.stats["replays"] == 3


@pytest.mark.parametrize("provider", ["vllm-fa3", "fa3", "fa4"])
def test_a_value_head_size_of_its_own_replays(provider: str) -> None:
    """Keys 192, values 128 (MLA's expanded prefill): the captured write is the fixed-shape
    scatter of each plane at its width (vllm-fa3 too: reshape_and_cache_flash is not used for
    two planes of two widths), the schedule planned with headdim_v."""
    m = Model(provider, head_size=192, head_size_v=128)
    runner = GraphRunner(
        m.backend, m.step, capture_sizes=[4], max_blocks_per_req=WIDTH, kv_caches=[m.cache]
    )
    for seqs in ([3, 9, 1, 4], [17, 2, 40, 5]):
        batch = m.batch([1] * 4, seqs)
        q, k, v = m.inputs(batch)
        want = m.reference(batch, q, k, v)
        out = runner.run(batch, q, k, v)
        assert out.shape[-1] == 128
        m.check(out, want, f"seq_lens {seqs}")
    assert runner.stats["captures"] == 1 and runner.stats["replays"] == 2


@pytest.mark.parametrize("provider", ["vllm", "fa4", "vllm-fa3"])
def test_a_graph_baking_the_steps_own_max_seqlen_k_is_refused_on_a_longer_replay(
    provider: str,
) -> None:
    """What capturing ordinary metadata would do: the kernel's max_seqlen_k is the capture
    step's, and a replay with a longer sequence gets a grid sized for shorter ones (the
    emulated kernel refuses it, where the GPU would compute garbage). Providers that take
    max_seqlen_k."""
    m = Model(provider)
    bs = m.spec.block_size
    pad = PaddedStep(
        query_start_loc=torch.arange(5, dtype=torch.int32),
        seq_lens=torch.tensor([2, 3, 1, 2], dtype=torch.int32),
        block_table=m.table[:4, :WIDTH].clone(),
        slot_mapping=torch.full((4,), -1, dtype=torch.int64),
        num_real_tokens=4,
        max_query_len=1,
        max_seq_len=3,
    )
    buffers = PersistentBatch(4, 4, WIDTH, bs, m.backend.device)
    batch = buffers.load(pad)
    q, k, v = m.inputs(batch)
    meta = m.builder.build(batch)  # the step's own max_seqlen_k (3)
    adaptor = EagerAdaptor()
    graph = adaptor.capture(lambda: m.step(q, k, v, meta))
    longer = PaddedStep(**{**pad.__dict__, "seq_lens": torch.tensor([2, 3 * bs, 1, 2])})
    buffers.load(longer)
    with pytest.raises(FlashOpError, match="max_seqlen_k = 3 is below"):
        adaptor.replay(graph)


def test_vllm_fa3_plans_the_schedule_again_before_every_replay() -> None:
    m = Model("vllm-fa3")
    runner = GraphRunner(
        m.backend, m.step, capture_sizes=[4], max_blocks_per_req=WIDTH, kv_caches=[m.cache]
    )
    emulator.reset_call_counts()
    for seqs in ([3, 9, 1, 4], [17, 2, 40, 5]):
        batch = m.batch([1] * 4, seqs)
        q, k, v = m.inputs(batch)
        want = m.reference(batch, q, k, v)
        with emulator.record_calls() as calls:
            m.check(runner.run(batch, q, k, v), want, f"seq_lens {seqs}")
        attention = [c for c in calls if c.name.endswith("flash_attn_varlen_func")]
        if runner.stats["replays"] > 1:  # a replay launches no Python: only the update
            assert not attention
        assert [c.kwargs["num_splits"] for c in calls if c.name == SCHEDULE][-1] == 32
    # capture: the build's schedule; then one per replay (the update)
    assert emulator.call_counts[SCHEDULE] == 1 + 2
    batch = m.batch([1] * 4, [18, 3, 41, 6])
    q, k, v = m.inputs(batch)
    runner.builder.update_graph_params = lambda *a: None  # type: ignore[method-assign]
    with pytest.raises(FlashOpError, match="planned for other sequence lengths"):
        runner.run(batch, q, k, v)


@pytest.mark.parametrize("provider", ["vllm-fa3", "fa3"])
def test_always_providers_replay_mixed_batches_captured_once(provider: str) -> None:
    """A mixed batch (decodes and a chunk of prefill) captured once at (T tokens, R requests)
    and replayed with other mixed batches of that shape: max_seqlen_q is T, the schedule (where
    planned) refreshed; each replay matches the reference. Driven without the runner (its
    mixed descriptors: the conformance suite's graph cases)."""
    m = Model(provider)
    bs = m.spec.block_size
    buffers = PersistentBatch(8, 4, WIDTH, bs, m.backend.device)

    def load(query_lens: list[int], seq_lens: list[int]) -> tuple[BatchMetadata, BatchMetadata]:
        real = m.batch(query_lens, seq_lens)
        ends = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
        pad = PaddedStep(
            query_start_loc=ends,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=m.table[:4, :WIDTH].clone(),
            slot_mapping=real.host_slot_mapping().clone(),
            num_real_tokens=8,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        return real, buffers.load(pad)

    real, batch = load([1, 5, 1, 1], [9, 20, 3, 30])
    q, k, v = (torch.zeros_like(t) for t in m.inputs(real))
    static = [t.clone() for t in (q, k, v)]
    meta = m.builder.build_for_graph_capture(batch)
    adaptor = EagerAdaptor()
    graph = adaptor.capture(lambda: m.step(*static, meta))
    for query_lens, seq_lens in (([2, 1, 4, 1], [2, 33, 40, 7]), ([1, 1, 1, 5], [50, 1, 9, 5])):
        real, batch = load(query_lens, seq_lens)
        q, k, v = m.inputs(real)
        want = m.reference(real, q, k, v)
        for buf, x in zip(static, (q, k, v), strict=True):
            buf.copy_(x)
        m.builder.update_graph_params(meta, batch, None)
        adaptor.replay(graph)
        m.check(graph.output, want, f"mixed replay {query_lens} / {seq_lens}")


@pytest.mark.parametrize("provider", ["vllm", "fa2", "fa4"])
def test_uniform_batch_providers_refuse_to_capture_a_mixed_batch(provider: str) -> None:
    m = Model(provider)
    with pytest.raises(UnsupportedConfigurationError, match="uniform_batch"):
        m.builder.build_for_graph_capture(m.batch([1, 3], [9, 20]))


def test_an_ordinary_step_keeps_its_own_maxima_and_the_kernels_split_heuristic() -> None:
    """Capture support changes nothing eager: the step's own max_seqlen_k, num_splits 0."""
    m = Model("vllm-fa3")
    batch = m.batch([1, 4], [9, 20])
    meta = m.builder.build(batch)
    assert meta.main is not None and not meta.graph
    assert meta.main.max_seq_len == 20 and meta.main.num_splits == 0
    q, k, v = m.inputs(batch)
    want = m.reference(batch, q, k, v)
    m.check(m.impl.forward(q, k, v, m.cache, meta), want, "eager")
