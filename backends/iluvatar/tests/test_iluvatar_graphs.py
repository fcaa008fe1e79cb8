"""Graph capture of the iluvatar backend: one-token decodes, as Iluvatar's vLLM fork captures
them, with the decode kernels' graph arguments (``use_cuda_graph=True``, ``max_context_len``
sized for the graph), every KV-cache mode; on attnhub's eager tape, each emulated op one launch.

Shown here: the captured calls carry the graph arguments and the graph's bound, so replays
with longer contexts than the capture step's are right; a decode launched into a capture with
the eager arguments is refused by the emulated kernel, as the fork never does it; non-causal
specs do not capture. The conformance suite's graph cases run the backend through
``GraphRunner`` too.
"""

from __future__ import annotations

from typing import Any

import iluvatar_helpers as h
import pytest
import torch
from attnhub_iluvatar import IluvatarBackend, emulator
from attnhub_iluvatar.emulator import IxformerOpError

from attnhub import BatchMetadata, GraphSupport, testing
from attnhub.graphs import EagerAdaptor, GraphRunner
from attnhub.spec import AttentionType

WIDTH = 4
PAGED = {
    "int8": "inference.functions.vllm_paged_attention_int8",
    "int8_k": "inference.functions.vllm_paged_attention_mix",
}


class Model:
    def __init__(self, kv_cache_dtype: str = "auto") -> None:
        self.spec = h.spec(kv_cache_dtype=kv_cache_dtype)
        self.backend = IluvatarBackend(self.spec, "cpu", emulate=True)
        self.g = testing.generator(5)
        bs = self.spec.block_size
        num_blocks = 1 + 8 * WIDTH
        self.table = testing.shuffled_block_table([WIDTH * bs] * 8, bs, num_blocks, self.g)
        self.cache = self.backend.allocate_kv_cache(num_blocks)
        testing.fill_cache_random(self.cache, self.g)
        self.impl = self.backend.impl()
        self.twin = self.backend.impl()  # the eager twin's layer (its own checks' memo)
        # a warm-up step before any capture, as an engine's (and CUDAGraphAdaptor's): the
        # static value scale's one host check happens here, never inside a capture
        warm = self.batch([4])
        self.step(
            *testing.random_qkv(self.spec, 1, self.g), self.backend.metadata_builder().build(warm)
        )

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> Any:
        return self.impl.forward(q, k, v, self.cache, meta)

    def batch(self, seq_lens: list[int]) -> BatchMetadata:
        n = len(seq_lens)
        return BatchMetadata.from_lengths([1] * n, seq_lens, self.table[:n], self.spec.block_size)

    def run_checked(self, runner: GraphRunner, seq_lens: list[int]) -> list[emulator.Call]:
        """One step through the runner, compared with an eager twin on a copy of the cache
        (output and cache bytes); the emulated calls the runner's step made."""
        batch = self.batch(seq_lens)
        q, k, v = testing.random_qkv(self.spec, batch.num_tokens, self.g)
        eager_cache = self.cache.clone()
        meta = self.backend.metadata_builder().build(batch)
        want = self.twin.forward(q, k, v, eager_cache, meta)  # eager twin on a copy
        with emulator.record_calls() as calls:
            out = runner.run(batch, q, k, v)
        tol = self.backend.capabilities.tolerance(self.spec.dtype)
        testing.assert_within(out, want, tol, f"replay with seq_lens {seq_lens}")
        for name, plane in self.cache.planes().items():
            assert torch.equal(plane, eager_cache.planes()[name]), name
        return calls


def test_the_level_and_its_reason() -> None:
    caps = IluvatarBackend.capabilities
    assert caps.graph_capture == GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert "use_cuda_graph=True" in caps.graph_capture_reason
    enc = h.spec(attn_type=AttentionType.ENCODER_ONLY)
    non_causal = IluvatarBackend(enc, "cpu", emulate=True)
    assert non_causal.metadata_builder().graph_support == GraphSupport.NEVER


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "int8_k"])
def test_captured_decodes_take_the_graph_arguments_and_replay_longer_contexts(
    kv_cache_dtype: str,
) -> None:
    m = Model(kv_cache_dtype)
    bs = m.spec.block_size
    runner = GraphRunner(
        m.backend, m.step, capture_sizes=[4], max_blocks_per_req=WIDTH, kv_caches=[m.cache]
    )
    calls = m.run_checked(runner, [3, 2, 5, 1])  # the capture step: short contexts
    name = PAGED.get(kv_cache_dtype, h.KVCACHE)
    decode = [c for c in calls if c.name == name]
    assert decode and all(c.kwargs["use_cuda_graph"] is True for c in decode)
    assert {c.kwargs["max_context_len"] for c in decode} == {WIDTH * bs}
    for seqs in ([WIDTH * bs, bs + 1, 7, 2], [9, WIDTH * bs - 1, 40, 17]):
        m.run_checked(runner, seqs)
    assert runner.stats["captures"] == 1 and runner.stats["replays"] == 3


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_decode_launched_into_a_capture_with_the_eager_arguments_is_refused(
    kv_cache_dtype: str,
) -> None:
    """What capturing ordinary metadata would do (use_cuda_graph=False, the step's own
    max_context_len): the emulated kernel refuses the launch, as a capture-unsafe one."""
    m = Model(kv_cache_dtype)
    batch = m.batch([3, 2, 5, 1])
    q, k, v = testing.random_qkv(m.spec, batch.num_tokens, m.g)
    m.step(q, k, v, m.backend.metadata_builder().build(batch))  # warm-up (scale checks)
    meta = m.backend.metadata_builder().build(batch)
    with pytest.raises(IxformerOpError, match="use_cuda_graph=False"):
        EagerAdaptor().capture(lambda: m.step(q, k, v, meta))
