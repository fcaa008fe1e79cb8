"""Threads that share attnhub objects: what is shared is read-only or per thread.

An engine may drive two models (or two replicas) through one backend instance and one
metadata builder from two threads, and several threads may discover and select backends at
once. The builder plans one step at a time (its ``step`` and a backend's planning scratch
belong to the step being planned); the impl remembers the last checked cache as one tuple;
the torch backend's gather buffers are per thread; discovery runs once under a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

import attnhub
from attnhub import AttentionSpec, BatchMetadata, PagedKVCache, Step
from attnhub.registry import Registry
from attnhub.testing import fill_cache_random, generator, make_batch, random_qkv
from attnhub.torch_backend import TorchBackend
from attnhub.torch_backend.backend import TorchMetadataBuilder

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.float32, block_size=8)
STEPS = 12


def _in_threads(n: int, work: Callable[[int], Any]) -> list[Any]:
    """``work(i)`` in ``n`` threads started together; their results, or their exceptions
    raised here."""
    start = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            start.wait(timeout=30)
            results[i] = work(i)
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return results


def _steps(seed: int) -> tuple[list[BatchMetadata], int]:
    """A thread's steps: batches of different shapes (decodes, a prefill, mixed)."""
    g = generator(seed)
    shapes = [([1, 1, 1], [30, 9, 17]), ([5], [21]), ([1, 4, 1], [12, 40, 3]), ([2, 2], [8, 9])]
    batches = []
    for i in range(STEPS):
        q, s = shapes[(i + seed) % len(shapes)]
        batch, _ = make_batch(q, s, SPEC.block_size, 24, seed=g)
        batches.append(batch)
    return batches, 24


def _drive(
    backend: TorchBackend, builder: Any, impl: Any, seed: int
) -> tuple[list[torch.Tensor], PagedKVCache]:
    """Every step of a thread through the shared builder and impl, into the thread's cache."""
    batches, num_blocks = _steps(seed)
    cache = backend.allocate_kv_cache(num_blocks)
    fill_cache_random(cache, generator(100 + seed))
    g = generator(200 + seed)
    outs = []
    for batch in batches:
        q, k, v = random_qkv(SPEC, batch.num_tokens, g)
        meta = builder.build(batch)
        outs.append(impl.forward(q, k, v, cache, meta).clone())
    return outs, cache


def test_two_threads_through_one_backend_and_builder_compute_what_one_thread_does() -> None:
    backend = TorchBackend(SPEC)
    alone = [_drive(backend, backend.metadata_builder(), backend.impl(), seed) for seed in (0, 1)]
    builder, impl = backend.metadata_builder(), backend.impl()  # shared by both threads
    together = _in_threads(2, lambda i: _drive(backend, builder, impl, i))
    for (outs, cache), (want_outs, want_cache) in zip(together, alone, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(outs, want_outs, strict=True))
        assert cache.equal(want_cache)


def test_steps_built_in_two_threads_gather_into_buffers_of_their_own() -> None:
    backend = TorchBackend(SPEC)
    builder = backend.metadata_builder()
    batch, _ = make_batch([1, 1], [30, 17], SPEC.block_size, 24, seed=generator(0))
    metas = _in_threads(2, lambda i: builder.build(batch))
    first, second = (m.gather_buffers for m in metas)
    assert first is not None and second is not None
    assert first[0].data_ptr() != second[0].data_ptr()
    assert first[1].data_ptr() != second[1].data_ptr()
    # within a thread the buffers are reused step after step
    again = builder.build(batch).gather_buffers
    assert again is not None and builder.build(batch).gather_buffers[0] is again[0]  # type: ignore[index]


class _Watched(TorchMetadataBuilder):
    """A builder whose plan waits (at most 0.5 s) for a second thread to come in, and notes
    whether the step it was handed is the one its thread built."""

    def __init__(self, backend: TorchBackend) -> None:
        super().__init__(backend)
        self.inside = 0
        self.count = threading.Lock()
        self.second_in = threading.Event()
        self.mismatches: list[str] = []

    def plan(self, step: Step) -> Mapping[str, Any]:
        with self.count:
            self.inside += 1
            first = self.inside == 1
            if not first:
                self.second_in.set()
        if first:
            self.second_in.wait(timeout=0.5)  # a bound, not a measurement
        try:
            planned = super().plan(step)
            assert step.facts.query_lens is not None
            if step.facts.query_lens.tolist() != step.batch.query_lens_cpu.tolist():
                self.mismatches.append(f"{step.facts.query_lens} for {step.batch}")
            return planned
        finally:
            with self.count:
                self.inside -= 1


def test_a_shared_builder_plans_each_thread_its_own_step() -> None:
    """``build`` hands ``plan`` the step it checked as an argument (no state on the builder):
    two threads planning at once each plan their own."""
    backend = TorchBackend(SPEC)
    builder = _Watched(backend)
    batches = [
        make_batch([1, 1], [30, 17], SPEC.block_size, 24, seed=generator(0))[0],
        make_batch([6], [6], SPEC.block_size, 24, seed=generator(1))[0],
    ]
    metas = _in_threads(2, lambda i: builder.build(batches[i]))
    assert builder.mismatches == []
    for meta, batch in zip(metas, batches, strict=True):
        alone = TorchMetadataBuilder(backend).build(batch)
        assert meta.batch is batch and meta.plan is not None and alone.plan is not None
        assert [c.block_ids.tolist() for c in meta.plan.chunks] == [
            c.block_ids.tolist() for c in alone.plan.chunks
        ]


def test_one_impl_called_from_two_threads_with_their_own_caches_checks_each_cache() -> None:
    """The impl remembers the last cache it checked as one tuple (planes and sizes): a thread
    never pairs its cache with the other's sizes."""
    backend = TorchBackend(SPEC)
    impl = backend.impl()
    builder = backend.metadata_builder()
    small, large = backend.allocate_kv_cache(4), backend.allocate_kv_cache(24)
    batch, _ = make_batch([1, 1], [30, 17], SPEC.block_size, 24, seed=generator(0))
    meta = builder.build(batch)  # needs more blocks than the small cache has
    q, k, v = random_qkv(SPEC, batch.num_tokens, generator(1))

    def work(i: int) -> list[str]:
        outcomes = []
        for _ in range(40):
            cache = small if i == 0 else large
            try:
                impl.forward(q, k, v, cache, meta)
                outcomes.append("ok")
            except attnhub.errors.InvalidInputError:
                outcomes.append("refused")
        return outcomes

    small_before = small.clone()
    refused, accepted = _in_threads(2, work)
    assert set(refused) == {"refused"} and set(accepted) == {"ok"}
    assert small.equal(small_before)


def test_discovery_and_selection_from_many_threads_agree() -> None:
    registry = Registry()  # fresh: the threads race to discover it

    def work(i: int) -> tuple[list[str], str, str]:
        names = [info.name for info in registry.infos()]
        chosen = registry.select(SPEC, "cpu", prefer="torch")
        return names, chosen.name, type(registry.get("torch")).__name__

    results = _in_threads(8, work)
    assert all(r == results[0] for r in results)
    assert "torch" in results[0][0]
    # every plugin registered once, however many threads raced to discover (tool-only plugins,
    # such as the suite's command, register beside the backends' own)
    names = [name for name, _ in registry.plugin_manager.list_name_plugin()]
    assert len(names) == len(set(names))
    assert {info.plugin for info in registry.infos() if info.backend is not None} <= set(names)


def test_selection_from_many_threads_gives_each_its_own_instance() -> None:
    backends = _in_threads(6, lambda i: attnhub.select_backend(SPEC, "cpu", prefer="torch"))
    assert len({id(b) for b in backends}) == len(backends)
    assert all(b.spec == SPEC for b in backends)
