"""Graph capture of the ascend backend on the emulated torch.npu graph API (npu_graph).

The backend captures FIA inside task groups; each step's update re-launches it with the
step's length lists. Shown here: replays follow new lengths (checked against the reference),
a replay whose update is skipped answers for the captured lengths (wrong), one whose event is
never recorded would hang, and an update not ordered after the previous replay is refused,
while the runner's event ordering needs no host synchronization per step.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ascend_helpers as h
import numpy as np
import pytest
import torch
from attnhub_ascend import AscendBackend, emulator, npu_graph
from attnhub_ascend.backend import RESHAPE_AND_CACHE, SCATTER_PA_KV_CACHE
from attnhub_ascend.emulator import NpuOpError
from attnhub_ascend.npu_graph import NpuGraphError

from attnhub import AttentionSpec, BatchMetadata, GraphSupport, reference, testing
from attnhub.errors import UnsupportedConfigurationError
from attnhub.graphs import GraphRunner, NPUGraphAdaptor
from attnhub.graphs.padding import pad_batch

BS = 128
NUM_BLOCKS = 24


class Model:
    """Two layers over their own caches on one emulated backend."""

    def __init__(self, spec: AttentionSpec | None = None, backend_cls: type = AscendBackend):
        self.spec = spec or h.spec(dtype=torch.float16)
        self.backend = backend_cls(self.spec, "cpu", emulate=True)
        g = testing.generator(5)
        self.sinks = testing.random_sinks(self.spec.num_heads, g) if self.spec.use_sinks else None
        self.impl = self.backend.impl(sinks=self.sinks)
        self.caches = [self.backend.allocate_kv_cache(NUM_BLOCKS) for _ in range(2)]
        for c in self.caches:
            testing.fill_cache_random(c, g)

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor:
        out = q
        for cache in self.caches:
            out = self.impl.forward(q, k, v, cache, meta)
        return out

    def runner(self, **kw: Any) -> GraphRunner:
        opts: dict[str, Any] = dict(
            capture_sizes=[4, 8], max_blocks_per_req=4, kv_caches=self.caches
        )
        opts.update(kw)
        return GraphRunner(self.backend, self.step, **opts)

    def check(self, out: torch.Tensor, batch: BatchMetadata, q: torch.Tensor, what: str) -> None:
        want, _ = reference.paged_attention(
            q[: batch.num_actual_tokens], self.caches[1], batch, self.spec, sinks=self.sinks
        )
        tol = self.backend.capabilities.tolerance(self.spec.dtype)
        testing.assert_within(out, want, tol, what, batch=batch)


def _decode(seq_lens: list[int], table: torch.Tensor) -> BatchMetadata:
    return BatchMetadata.from_lengths([1] * len(seq_lens), seq_lens, table, BS)


def _table(num_reqs: int, seed: int = 0) -> torch.Tensor:
    """Every request owns 4 blocks (room to grow to 512 tokens)."""
    return testing.shuffled_block_table(
        [4 * BS] * num_reqs, BS, NUM_BLOCKS, testing.generator(seed)
    )


def _qkv(spec: AttentionSpec, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    return testing.random_qkv(spec, n, testing.generator(seed))


class ScatterBackend(AscendBackend):
    kv_write_op = SCATTER_PA_KV_CACHE


class ReshapeBackend(AscendBackend):
    kv_write_op = RESHAPE_AND_CACHE


@pytest.mark.parametrize("backend_cls", [ScatterBackend, ReshapeBackend])
@pytest.mark.parametrize("sinks", [False, True])
def test_replays_follow_each_steps_lengths(backend_cls: type, sinks: bool) -> None:
    # sinks need a bfloat16 model (learnable_sink is bfloat16 only)
    spec = h.spec(dtype=torch.bfloat16 if sinks else torch.float16, use_sinks=sinks)
    model = Model(spec, backend_cls)
    runner = model.runner()
    table = _table(3)
    seqs = [100, 250, 7]
    for i in range(6):  # decode steps: every sequence grows by one token; one descriptor
        batch = _decode(seqs, table)
        q, k, v = _qkv(spec, 3, seed=i)
        out = runner.run(batch, q, k, v).clone()
        model.check(out, batch, q, f"step {i}")
        seqs = [s + 1 for s in seqs]
    other = _decode([300, 5, 60, 90, 1], _table(5, seed=1))  # another descriptor (8)
    q, k, v = _qkv(spec, 5, seed=9)
    model.check(runner.run(other, q, k, v).clone(), other, q, "5 requests")
    assert runner.stats == {"captures": 2, "replays": 7}


def test_a_replay_whose_update_is_skipped_answers_for_the_captured_lengths() -> None:
    model = Model()
    runner = model.runner()
    table = _table(3)
    first = _decode([100, 250, 7], table)
    runner.run(first, *_qkv(model.spec, 3, seed=0))
    grown = _decode([101, 251, 8], table)

    def events_only(graph_meta: Any, batch: BatchMetadata, stream: Any) -> None:
        for task in graph_meta.graph.tasks:  # the ordering, without the task update
            task.event.record(stream)

    q, k, v = _qkv(model.spec, 3, seed=1)
    runner.builder.update_graph_params = events_only  # type: ignore[method-assign]
    stale = runner.run(grown, q, k, v).clone()
    # the FIA tasks still carry the captured lengths: the new token's key is not attended
    with pytest.raises(AssertionError):
        model.check(stale, grown, q, "skipped update")
    captured_lengths = _decode([100, 250, 7], table)
    model.check(stale, captured_lengths, q, "what the captured lengths give")
    del runner.builder.update_graph_params  # the real hook again: the right answer
    q, k, v = _qkv(model.spec, 3, seed=2)
    model.check(runner.run(grown, q, k, v).clone(), grown, q, "updated")


def test_a_replay_whose_event_nothing_recorded_would_wait_forever() -> None:
    model = Model()
    runner = model.runner()
    table = _table(2)
    runner.run(_decode([10, 20], table), *_qkv(model.spec, 2, seed=0))
    runner.builder.update_graph_params = lambda *a: None  # type: ignore[method-assign]
    with pytest.raises(NpuGraphError, match="wait forever"):
        runner.run(_decode([11, 21], table), *_qkv(model.spec, 2, seed=1))


class UnorderedAdaptor(NPUGraphAdaptor):
    """Updates on a side stream with nothing ordering them after the previous replay."""

    @contextmanager
    def updating(self) -> Iterator[Any]:
        with self.npu.stream(self.update_stream):
            yield self.update_stream


class SeedAdaptor(UnorderedAdaptor):
    """vllm-ascend's ordering: the host synchronizes the device before every update."""

    @contextmanager
    def updating(self) -> Iterator[Any]:
        self.npu.synchronize()
        with super().updating() as stream:
            yield stream


def test_an_update_not_ordered_after_the_last_replay_is_refused() -> None:
    model = Model()
    runner = model.runner(adaptor=UnorderedAdaptor(npu_graph))
    table = _table(2)
    runner.run(_decode([10, 20], table), *_qkv(model.spec, 2, seed=0))
    with pytest.raises(NpuGraphError, match="before the replay ran it"):
        runner.run(_decode([11, 21], table), *_qkv(model.spec, 2, seed=1))


def test_events_order_updates_without_a_host_sync_per_step() -> None:
    table = _table(2)
    steps = [_decode([10 + i, 20 + i], table) for i in range(4)]
    syncs = []
    for adaptor in (NPUGraphAdaptor(npu_graph), SeedAdaptor(npu_graph)):
        model = Model()
        runner = model.runner(adaptor=adaptor)
        runner.run(steps[0], *_qkv(model.spec, 2, seed=0))  # capture (graph() synchronizes)
        before = sum(npu_graph.host_syncs.values())
        for i, batch in enumerate(steps[1:], 1):
            q, k, v = _qkv(model.spec, 2, seed=i)
            model.check(runner.run(batch, q, k, v).clone(), batch, q, f"{adaptor.name} {i}")
        syncs.append(sum(npu_graph.host_syncs.values()) - before)
    assert syncs == [0, 3]  # attnhub's runner: none; the seed's: one per step


def test_graph_support_is_never_for_specs_with_data_dependent_shapes() -> None:
    causal = h.backend(h.spec()).metadata_builder()
    assert causal.graph_support == GraphSupport.UNIFORM_BATCH
    for spec in (h.spec(sliding_window=200), h.spec(attn_type="encoder_only")):
        builder = h.backend(spec).metadata_builder()
        assert builder.graph_support == GraphSupport.NEVER
        batch, _ = testing.make_batch([1, 1], [10, 20], BS, 4, causal=spec.causal)
        with pytest.raises(UnsupportedConfigurationError, match="data-dependent shapes"):
            builder.build_for_graph_capture(batch)


# --- the emulated graph API's own rules ----------------------------------------------------------


def test_a_non_causal_batch_is_refused_at_capture_or_run_eagerly_with_the_fallback() -> None:
    """The builder captures causal batches only: a non-causal one (npu_fusion_attention's
    packed path) is refused by build_for_graph_capture, before any write; a runner with
    eager_fallback runs it eagerly, as every batch it cannot capture."""
    model = Model()
    batch = BatchMetadata.from_lengths([1, 1], [100, 7], _table(2), BS, causal=False)
    q, k, v = _qkv(model.spec, 2, seed=3)
    before = model.caches[0].clone()
    with pytest.raises(UnsupportedConfigurationError, match="non-causal batch"):
        model.runner().run(batch, q, k, v)
    assert torch.equal(model.caches[0].key, before.key)
    runner = model.runner(eager_fallback=True)
    model.check(runner.run(batch, q, k, v).clone(), batch, q, "a non-causal step")
    assert runner.stats == {"eager": 1}


def test_the_emulated_graph_api_refuses_what_the_device_refuses() -> None:
    npu = npu_graph
    s = npu.Stream()
    with pytest.raises(NpuGraphError, match="outside a capture"):
        npu.graph_task_group_begin(s)
    g = npu.NPUGraph()
    with pytest.raises(NpuGraphError, match="default stream"):
        g.capture_begin()
    x = torch.zeros(3)
    with npu.graph(g, stream=s):
        x.add_(1)
        npu.graph_task_group_begin(s)
        y = x * 2
        with pytest.raises(Exception, match="torch_npu op calls"):
            npu.graph_task_group_end(s)
    g.replay()
    assert x.tolist() == [2, 2, 2] and y.tolist() == [4, 4, 4]
    with pytest.raises(NpuGraphError, match="must come from graph_task_group_end"):
        npu.graph_task_update_begin(s, object())  # type: ignore[arg-type]


def test_a_task_update_may_pass_other_tensors_as_vllm_ascends_updates_do() -> None:
    # vllm-ascend's updates pass a workspace fetched per update and lengths made per step
    # (torch.cat-padded tensors, numpy arrays): the emulation refused any tensor but the
    # captured task's ("host-side arguments only")
    model = Model()
    runner = model.runner()
    table = _table(2)
    runner.run(_decode([10, 20], table), *_qkv(model.spec, 2, seed=0))
    entry = next(iter(runner.graphs.values()))
    grown = _decode([11, 21], table)
    q, k, v = _qkv(model.spec, 2, seed=1)

    def callers_update(graph_meta: Any, batch: BatchMetadata, stream: Any) -> None:
        kv = torch.cat([batch.seq_lens_cpu, torch.zeros(0, dtype=batch.seq_lens_cpu.dtype)])
        for task in graph_meta.graph.tasks:
            fresh = torch.empty_like(task.kwargs["workspace"])  # a workspace of this update
            npu_graph.graph_task_update_begin(stream, task.handle)
            kwargs = {**task.kwargs, "workspace": fresh}
            q_name, kv_name = task.list_names
            ends = np.asarray(batch.query_start_loc_cpu[1:].numpy())
            task.op(*task.args, **kwargs, **{q_name: ends, kv_name: kv})
            npu_graph.graph_task_update_end(stream)
            task.event.record(stream)
            keep.append(fresh)  # held until the replay, as the caller's weak refs assume

    keep: list[torch.Tensor] = []
    runner.builder.update_graph_params = callers_update  # type: ignore[method-assign]
    model.check(runner.run(grown, q, k, v).clone(), grown, q, "caller-style update")
    assert entry.meta.graph.tasks


def _fia_out_calls(calls: list[Any]) -> list[Any]:
    return [c for c in calls if c.name == "npu_fused_infer_attention_score.out"]


def test_the_capture_and_every_update_run_fia_in_one_workspace_per_graph() -> None:
    # vllm-ascend sizes one workspace per capture size with the max-workspace query and passes
    # it to the capture and every update; attnhub passed workspace=None
    model = Model()
    runner = model.runner()
    table = _table(3)
    with emulator.record_calls() as calls:
        for i, seqs in enumerate(([100, 250, 7], [101, 251, 8], [102, 252, 9])):
            runner.run(_decode(seqs, table), *_qkv(model.spec, 3, seed=i))
        runner.run(_decode([5, 6, 7, 8, 9], _table(5)), *_qkv(model.spec, 5, seed=9))
    metas = [e.meta for e in runner.graphs.values()]
    workspaces = [m.graph.workspaces[model.backend] for m in metas]
    assert len(workspaces) == 2 and workspaces[0] is not workspaces[1]  # one per capture size
    fia = _fia_out_calls(calls)
    warmups = [c for c in fia if c.kwargs["workspace"] is None]
    assert len(warmups) == 2 * 2  # each capture's eager warm-up run, two layers
    used = [c.kwargs["workspace"] for c in fia if c.kwargs["workspace"] is not None]
    # capture + 3 updates of the first graph, capture + 1 update of the second, two layers
    assert len(used) == 2 * (4 + 2)
    assert all(any(w is ws for ws in workspaces) for w in used)
    maxed = [c for c in calls if c.name == "_npu_fused_infer_attention_score_get_max_workspace"]
    assert len(maxed) == 2  # sized once per captured graph, at its capture


def test_a_task_update_without_a_workspace_is_refused_at_replay() -> None:
    # .out with workspace=None allocates one for the update's launch and frees it when the
    # update returns: the replay would read freed memory (what attnhub's updates did)
    model = Model()
    runner = model.runner()
    table = _table(2)
    runner.run(_decode([10, 20], table), *_qkv(model.spec, 2, seed=0))

    def update_without_workspace(graph_meta: Any, batch: BatchMetadata, stream: Any) -> None:
        for task in graph_meta.graph.tasks:
            npu_graph.graph_task_update_begin(stream, task.handle)
            q_name, kv_name = task.list_names
            lists = {
                q_name: tuple(batch.query_start_loc_cpu[1:].tolist()),
                kv_name: tuple(batch.seq_lens_cpu.tolist()),
            }
            task.op(*task.args, **{**task.kwargs, "workspace": None}, **lists)
            npu_graph.graph_task_update_end(stream)
            task.event.record(stream)

    runner.builder.update_graph_params = update_without_workspace  # type: ignore[method-assign]
    with pytest.raises(NpuGraphError, match="freed when the update returned"):
        runner.run(_decode([11, 21], table), *_qkv(model.spec, 2, seed=1))


def test_a_workspace_nothing_holds_any_more_is_refused_at_replay() -> None:
    # the tasks hold their workspace weakly, as a device graph holds an address: memory the
    # caller let go of may be reused before the replay reads it
    model = Model()
    runner = model.runner()
    table = _table(2)
    runner.run(_decode([10, 20], table), *_qkv(model.spec, 2, seed=0))
    entry = next(iter(runner.graphs.values()))
    entry.meta.graph.workspaces.clear()
    for task in entry.meta.graph.tasks:
        del task.kwargs["workspace"]
    gc.collect()
    stream = runner.adaptor.update_stream
    with pytest.raises(NpuGraphError, match="workspace was freed"):
        with npu_graph.stream(stream):
            for task in entry.meta.graph.tasks:  # the order without the updates
                task.event.record(stream)
        entry.graph.graph.replay()


def test_a_workspace_sized_for_the_captured_lengths_is_too_small_for_longer_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # sized by the ordinary query for the capture's own lengths, not by the max query
    def for_these_lengths(*args: Any, **kwargs: Any) -> torch.Tensor:
        need = emulator._workspace_bytes(kwargs["num_heads"], kwargs["actual_seq_lengths_kv"])
        return torch.empty(need, dtype=torch.uint8)

    monkeypatch.setattr(
        emulator, "_npu_fused_infer_attention_score_get_max_workspace", for_these_lengths
    )
    model = Model()
    runner = model.runner()
    table = _table(2)
    runner.run(_decode([10, 20], table), *_qkv(model.spec, 2, seed=0))
    runner.run(_decode([11, 21], table), *_qkv(model.spec, 2, seed=1))  # the same splits
    with pytest.raises(NpuOpError, match=r"workspace of \d+ bytes, this call needs"):
        runner.run(_decode([300, 400], table), *_qkv(model.spec, 2, seed=2))


class WrapperOrderRunner(GraphRunner):
    """vllm-ascend's ACLGraphWrapper order: synchronize, replay (each FIA task waits on its
    event), then update the tasks and record their events (update_attn_params)."""

    def run(self, batch: BatchMetadata, *inputs: torch.Tensor) -> Any:
        desc = self.descriptor(batch)
        assert not isinstance(desc, str)
        padded = pad_batch(batch, desc, self.width)
        step_batch = self.batch_buffers.load(padded, causal=batch.causal)
        static = self.input_buffers.load(inputs, padded.num_real_tokens, desc.num_tokens)
        entry = self.graphs.get(desc)
        if entry is None:  # the capture as the runner makes it, with its first update
            del static
            return super().run(batch, *inputs)
        npu = self.adaptor.npu
        npu.synchronize()
        entry.graph.graph.replay()
        stream = self.adaptor.update_stream
        with npu.stream(stream):
            self.builder.update_graph_params(entry.meta, step_batch, stream)
        return entry.graph.output[: padded.num_real_tokens]


def test_vllm_ascends_order_replay_then_update_is_accepted() -> None:
    # the replay's captured waits hold each FIA task until the update after it records the
    # event; the emulation raised "nothing recorded" at the replay instead
    model = Model()
    runner = WrapperOrderRunner(
        model.backend,
        model.step,
        capture_sizes=[4],
        max_blocks_per_req=4,
        kv_caches=model.caches,
    )
    table = _table(3)
    for i, seqs in enumerate(([100, 250, 7], [101, 251, 8], [102, 252, 9])):
        batch = _decode(seqs, table)
        q, k, v = _qkv(model.spec, 3, seed=i)
        model.check(runner.run(batch, q, k, v).clone(), batch, q, f"step {i}")


def test_an_update_of_a_task_the_blocked_replay_already_ran_is_refused() -> None:
    model = Model()
    runner = model.runner()
    table = _table(2)
    runner.run(_decode([10, 20], table), *_qkv(model.spec, 2, seed=0))
    entry = next(iter(runner.graphs.values()))
    first, second = entry.meta.graph.tasks
    npu_graph.synchronize()
    entry.graph.graph.replay()  # blocked at the first layer's wait
    stream = runner.adaptor.update_stream
    with npu_graph.stream(stream):
        first.event.record(stream)  # released without its update: runs the first task
        with pytest.raises(NpuGraphError, match="already passed"):
            npu_graph.graph_task_update_begin(stream, first.handle)
        second.event.record(stream)
