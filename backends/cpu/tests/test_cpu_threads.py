"""Two threads through the cpu backend at once: vLLM's CPU attention kernel works in one
process-wide scratch buffer, so ``attnhub_cpu.ops.Kernels`` calls it one call at a time."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from attnhub_cpu import ops

import attnhub
from attnhub import testing


def test_every_attention_call_holds_the_kernel_lock(kernels: object) -> None:
    """What the lock promises, read where the kernel is entered (no timing involved)."""
    held: list[bool] = []

    class Spy:
        def cpu_attention_with_kv_cache(self, *args: Any) -> None:
            held.append(ops.KERNEL_LOCK.locked())

    ops.Kernels(Spy()).cpu_attention_with_kv_cache(1, 2, 3)
    assert held == [True]
    assert not ops.KERNEL_LOCK.locked()
    assert isinstance(kernels, ops.Kernels)  # what the backend calls through


def test_two_threads_get_the_bits_one_thread_gets(kernels: object) -> None:
    """Regression: before the lock, two threads calling the kernel at once gave outputs that
    differed from the same calls made one after the other (their partial results mixed in
    vLLM's shared scratch buffer), in about one run of the suite's two-thread case in eight.
    Many long calls per thread here make an overlap all but certain."""
    spec = attnhub.AttentionSpec(
        num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float32, block_size=32
    )
    backend = attnhub.select_backend(spec, "cpu", prefer="cpu")
    g = testing.generator(7)
    work = []
    for query_lens, seq_lens in (([1, 1, 37, 1], [300, 517, 400, 64]), ([5, 1, 1], [600, 90, 333])):
        batch, num_blocks = testing.make_batch(query_lens, seq_lens, spec.block_size, seed=g)
        cache = backend.allocate_kv_cache(num_blocks)
        testing.fill_cache_random(cache, g)
        q, _, _ = testing.random_qkv(spec, batch.num_actual_tokens, g)
        work.append((backend.metadata_builder().build(batch), cache, q))
    impl = backend.impl()

    def run(i: int) -> list[torch.Tensor]:
        meta, cache, q = work[i]
        return [impl.forward(q, None, None, cache, meta) for _ in range(40)]

    alone = [run(0)[0], run(1)[0]]
    got: list[list[torch.Tensor]] = [[], []]
    barrier = threading.Barrier(2)

    def thread(i: int) -> None:
        barrier.wait(timeout=60)
        got[i] = run(i)

    threads = [threading.Thread(target=thread, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for i in range(2):
        assert len(got[i]) == 40, f"thread {i} did not finish"
        differing = [n for n, out in enumerate(got[i]) if not torch.equal(out, alone[i])]
        assert not differing, f"thread {i}: calls {differing} differ from the same call alone"


@pytest.fixture(autouse=True)
def _one_thread_each() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
