"""attnhub.graphs: capture sizes, descriptors, padding, the tape, the runner (torch backend)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import attnhub
from attnhub import AttentionSpec, GraphSupport, testing
from attnhub.errors import InvalidInputError, UnsupportedConfigurationError
from attnhub.graphs import (
    BatchDescriptor,
    BatchTooLargeError,
    CaptureSizes,
    EagerAdaptor,
    GraphCaptureError,
    GraphRunner,
    NotCapturableBatchError,
    PaddedStep,
    Tape,
    describe,
    pad_batch,
)
from attnhub.graphs.runner import checked_caches
from attnhub.torch_backend.backend import TorchBackend
from attnhub.validation import check_step

BS = 16
SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, block_size=BS, dtype=torch.float32)
TOL = TorchBackend.capabilities.tolerances[torch.float32]


# --- sizes and descriptors ----------------------------------------------------------------------


def test_capture_sizes_pad_to_the_next_size_and_name_a_batch_too_large() -> None:
    sizes = CaptureSizes([8, 1, 4, 4])
    assert sizes.sizes == (1, 4, 8)
    assert [sizes.size_for(n) for n in (1, 2, 4, 5, 8)] == [1, 4, 4, 8, 8]
    assert sizes.size_for(3, query_len=2) == 4  # whole requests of 2 tokens
    with pytest.raises(BatchTooLargeError, match=r"9 tokens.*largest capture size is 8"):
        sizes.size_for(9)
    with pytest.raises(BatchTooLargeError, match="multiple of the query length 3"):
        sizes.size_for(5, query_len=3)
    assert CaptureSizes.up_to(20).sizes == (1, 2, 4, 8, 16, 20)
    with pytest.raises(InvalidInputError, match="capture size 0"):
        CaptureSizes([0, 4])


def _batch(query_lens: list[int], seq_lens: list[int], seed: int = 0, num_blocks: int = 64):
    batch, _ = testing.make_batch(query_lens, seq_lens, BS, num_blocks, seed=seed)
    return batch


def test_descriptors_follow_the_declared_level() -> None:
    sizes = CaptureSizes([4, 8])
    decode = _batch([1, 1, 1], [5, 40, 17])
    assert describe(decode, sizes, GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE) == BatchDescriptor(
        num_tokens=4, num_reqs=4, uniform_decode=True
    )
    spec_decode = _batch([2, 2, 2], [5, 40, 17])
    assert describe(spec_decode, sizes, GraphSupport.UNIFORM_BATCH) == BatchDescriptor(
        num_tokens=8, num_reqs=4, uniform_decode=True
    )
    why = describe(spec_decode, sizes, GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE)
    assert isinstance(why, str) and "one-token decodes" in why
    mixed = _batch([1, 3], [5, 40])
    why = describe(mixed, sizes, GraphSupport.UNIFORM_BATCH)
    assert isinstance(why, str) and "different query lengths" in why


def test_padding_adds_dummy_requests_that_every_step_check_accepts() -> None:
    batch = _batch([1, 1, 1], [5, 40, 17])
    desc = BatchDescriptor(num_tokens=8, num_reqs=8, uniform_decode=True)
    padded = pad_batch(batch, desc, width=6)
    assert padded.seq_lens.tolist() == [5, 40, 17, 1, 1, 1, 1, 1]
    assert padded.query_start_loc.tolist() == list(range(9))
    assert padded.slot_mapping[:3].tolist() == batch.slot_mapping.tolist()
    assert padded.slot_mapping[3:].tolist() == [-1] * 5  # dummies write nothing
    assert padded.block_table.shape == (8, 6)
    assert padded.block_table[3:].eq(0).all()
    assert torch.equal(padded.block_table[:3, : batch.block_table.shape[1]], batch.block_table)
    backend = TorchBackend(SPEC, "cpu")
    runner = GraphRunner(
        backend,
        lambda *a: None,
        capture_sizes=[8],
        max_blocks_per_req=6,
        kv_caches=[backend.allocate_kv_cache(48)],
    )
    step_batch = runner.batch_buffers.load(padded)
    assert check_step(SPEC, step_batch, torch.device("cpu")).max_slot == int(
        batch.slot_mapping.max()
    )
    with pytest.raises(InvalidInputError, match=r"request 1 \(seq_len 40\) needs 3 blocks"):
        pad_batch(batch, desc, width=2)


def test_an_always_backend_gets_mixed_descriptors() -> None:
    """A mixed batch under ALWAYS: its requests padded to a capture size, its tokens to one
    with room for a one-token dummy per missing request."""
    sizes = CaptureSizes([2, 4, 8, 16])
    mixed = _batch([1, 3], [5, 40])  # 2 requests, 4 tokens: a size each, no dummy
    assert describe(mixed, sizes, GraphSupport.ALWAYS) == BatchDescriptor(
        num_tokens=4, num_reqs=2, uniform_decode=False
    )
    three = _batch([1, 1, 5], [5, 40, 9])  # 3 requests -> 4; 7 tokens + 1 dummy -> 8
    assert describe(three, sizes, GraphSupport.ALWAYS) == BatchDescriptor(
        num_tokens=8, num_reqs=4, uniform_decode=False
    )
    decode = _batch([1, 1, 1], [5, 40, 17])  # uniform batches keep their descriptors
    assert describe(decode, sizes, GraphSupport.ALWAYS) == BatchDescriptor(
        num_tokens=4, num_reqs=4, uniform_decode=True
    )
    spare = _batch([1, 4], [5, 40])  # 2 requests (a size), 5 tokens: the 3 spare need a dummy
    desc = describe(spare, sizes, GraphSupport.ALWAYS)
    assert desc == BatchDescriptor(num_tokens=8, num_reqs=4, uniform_decode=False)
    assert pad_batch(spare, desc, width=4).query_start_loc.tolist() == [0, 1, 5, 7, 8]
    full = _batch([1, 15], [5, 40])  # the largest size, every token real
    assert describe(full, sizes, GraphSupport.ALWAYS) == BatchDescriptor(
        num_tokens=16, num_reqs=2, uniform_decode=False
    )
    # Regression: the error counted the dummy request's token as the batch's own (17 tokens)
    with pytest.raises(
        BatchTooLargeError, match=r"batch of 16 tokens needs .* least 17 \(.* 3 requests .* 4: 1"
    ) as raised:
        describe(_batch([1, 1, 14], [5, 40, 20]), sizes, GraphSupport.ALWAYS)  # 16 + 1 dummy
    assert raised.value.num_tokens == 16
    # 16 requests (the largest size), 17 tokens: too many tokens already, no dummy named
    with pytest.raises(BatchTooLargeError, match=r"batch of 17 tokens needs .* least 17;"):
        describe(_batch([1] * 15 + [2], [5] * 16), sizes, GraphSupport.ALWAYS)
    with pytest.raises(BatchTooLargeError, match=r"batch of 20 tokens needs .* least 20;"):
        describe(_batch([1] * 20, [5] * 19 + [6]), sizes, GraphSupport.ALWAYS)  # 20 requests


def _padded_batch(padded: PaddedStep, spec: AttentionSpec = SPEC) -> attnhub.BatchMetadata:
    """``padded`` in a runner's persistent buffers: the batch a captured step runs with."""
    backend = TorchBackend(spec, "cpu")
    runner = GraphRunner(
        backend,
        lambda *a: None,
        capture_sizes=[int(padded.slot_mapping.shape[0])],
        max_blocks_per_req=int(padded.block_table.shape[1]),
        kv_caches=[backend.allocate_kv_cache(1)],
    )
    return runner.batch_buffers.load(padded)


def test_mixed_padding_adds_dummies_for_spare_tokens() -> None:
    batch = _batch([1, 3], [5, 40])
    desc = BatchDescriptor(num_tokens=8, num_reqs=4, uniform_decode=False)
    padded = pad_batch(batch, desc, width=4)
    assert padded.query_start_loc.tolist() == [0, 1, 4, 6, 8]  # the 4 spare tokens: 2 + 2
    assert padded.seq_lens.tolist() == [5, 40, 2, 2]
    assert padded.slot_mapping[:4].tolist() == batch.slot_mapping.tolist()
    assert padded.slot_mapping[4:].tolist() == [-1] * 4
    assert padded.block_table[2:].eq(0).all()
    assert (padded.num_real_tokens, padded.max_query_len, padded.max_seq_len) == (4, 3, 40)
    check_step(SPEC, _padded_batch(padded), torch.device("cpu"))


def test_mixed_padding_splits_causal_requests_and_changes_no_answer() -> None:
    """Requests the dummies cannot make up: the last requests' last tokens become requests
    of their own over the same blocks; the reference gives every real row the same answer."""
    batch = _batch([1, 6], [5, 40], seed=3)
    desc = BatchDescriptor(num_tokens=8, num_reqs=6, uniform_decode=False)
    padded = pad_batch(batch, desc, width=4)
    # 1 spare token: one dummy; 3 more requests: the 6-token request's last 3 tokens
    assert padded.query_start_loc.tolist() == [0, 1, 4, 5, 6, 7, 8]
    assert padded.seq_lens.tolist() == [5, 37, 38, 39, 40, 1]
    table = batch.block_table
    for r, owner in enumerate([0, 1, 1, 1, 1]):
        assert torch.equal(padded.block_table[r, : table.shape[1]], table[owner])
    assert padded.slot_mapping[:7].tolist() == batch.slot_mapping.tolist()
    step = _padded_batch(padded)
    check_step(SPEC, step, torch.device("cpu"))
    backend = TorchBackend(SPEC, "cpu")
    cache = backend.allocate_kv_cache(64)
    testing.fill_cache_random(cache, testing.generator(5))
    query = torch.randn(8, SPEC.num_heads, SPEC.head_size, generator=testing.generator(6))
    want, _ = attnhub.reference.paged_attention(query[:7], cache, batch, SPEC)
    got, _ = attnhub.reference.paged_attention(query, cache, step, SPEC)
    torch.testing.assert_close(got[:7], want, rtol=1e-12, atol=1e-12)
    # every token its own request (R == T): a full split
    full = pad_batch(batch, BatchDescriptor(8, 8, uniform_decode=False), width=4)
    assert full.query_start_loc.tolist() == list(range(9))
    assert full.seq_lens.tolist() == [5, 35, 36, 37, 38, 39, 40, 1]


def test_mixed_padding_refuses_what_it_cannot_pad() -> None:
    batch = _batch([1, 6], [5, 40])
    with pytest.raises(InvalidInputError, match="spare tokens need a padding request"):
        pad_batch(batch, BatchDescriptor(8, 2, uniform_decode=False), width=4)
    with pytest.raises(InvalidInputError, match="does not fit"):
        pad_batch(batch, BatchDescriptor(8, 9, uniform_decode=False), width=4)
    noncausal, _ = testing.make_batch([1, 6], [5, 40], BS, 64, causal=False)
    with pytest.raises(InvalidInputError, match="only causal queries can be split"):
        pad_batch(noncausal, BatchDescriptor(8, 6, uniform_decode=False), width=4)
    with pytest.raises(InvalidInputError, match=r"request 1 \(seq_len 40\) needs 3 blocks"):
        pad_batch(batch, BatchDescriptor(8, 3, uniform_decode=False), width=2)
    with pytest.raises(InvalidInputError, match="a padding request of 53 tokens needs 4 blocks"):
        pad_batch(batch, BatchDescriptor(60, 3, uniform_decode=False), width=3)


# --- the tape -----------------------------------------------------------------------------------


def test_a_tape_replays_ops_on_new_buffer_contents_with_host_values_frozen() -> None:
    buf = torch.arange(6.0)
    out = torch.empty(3)
    n = [3]  # a host value the step reads at capture

    def step() -> None:
        k = n[0]  # baked into the ops' shapes, as a kernel argument would be
        torch.mul(buf[:k], 2, out=out[:k])

    tape = Tape()
    with tape.recording():
        step()
    assert out.tolist() == [0, 2, 4]
    buf.copy_(torch.arange(6.0) + 10)
    n[0] = 1  # a device graph would not see this
    tape.replay()
    assert out.tolist() == [20, 22, 24]


def test_a_tape_refuses_host_reads_and_data_dependent_shapes_at_capture() -> None:
    x = torch.tensor([0, 3, 0, 5])
    for bad, named in (
        (lambda: x.sum().item(), "host read"),
        (lambda: bool(x.any()), "host read"),
        (lambda: x.nonzero(), "nonzero"),
        (lambda: x[x > 0], "boolean mask"),
        (lambda: torch.repeat_interleave(x, x), "repeat_interleave"),
    ):
        with pytest.raises(GraphCaptureError, match=named), Tape().recording():
            bad()


def test_the_eager_adaptor_replays_what_was_captured_not_the_python() -> None:
    calls = []
    buf = torch.zeros(2)

    def step() -> torch.Tensor:
        calls.append(1)
        return buf + 1

    adaptor = EagerAdaptor()
    captured = adaptor.capture(step)
    buf.fill_(5)
    adaptor.replay(captured)
    adaptor.replay(captured)
    assert len(calls) == 2  # the warm-up and the recorded run; replays run no Python
    assert captured.output.tolist() == [6, 6]


# --- the runner with the torch backend ------------------------------------------------------------


class Model:
    """Two attention layers over their own caches; the step returns the last layer's output."""

    def __init__(self, spec: AttentionSpec = SPEC, num_blocks: int = 48) -> None:
        self.spec = spec
        self.backend = TorchBackend(spec, "cpu")
        self.impl = self.backend.impl()
        g = testing.generator(1)
        self.caches = [self.backend.allocate_kv_cache(num_blocks) for _ in range(2)]
        for c in self.caches:
            testing.fill_cache_random(c, g)
        self.num_blocks = num_blocks

    def step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: attnhub.AttentionMetadata
    ) -> torch.Tensor:
        out = q
        for cache in self.caches:
            out = self.impl.forward(q, k, v, cache, meta)
        return out

    def runner(self, **kw: object) -> GraphRunner:
        opts: dict = dict(capture_sizes=[2, 4, 8], max_blocks_per_req=8, kv_caches=self.caches)
        opts.update(kw)
        return GraphRunner(self.backend, self.step, **opts)


def _step_inputs(spec: AttentionSpec, batch: attnhub.BatchMetadata, seed: int):
    return testing.random_qkv(spec, batch.num_tokens, testing.generator(seed))


@pytest.mark.parametrize("query_len", [1, 2])
def test_replays_of_one_descriptor_match_eager_and_the_reference(query_len: int) -> None:
    graphed, eager = Model(), Model()
    runner = graphed.runner()
    builder = eager.backend.metadata_builder()
    g = testing.generator(7)
    for i, num_reqs in enumerate([3, 4, 3, 1, 2, 4, 1]):
        seqs = torch.randint(query_len, 120, (num_reqs,), generator=g).tolist()
        batch = _batch([query_len] * num_reqs, seqs, seed=i, num_blocks=48)
        q, k, v = _step_inputs(SPEC, batch, seed=i)
        _, expected = testing.reference_after_write(SPEC, graphed.caches[1], batch, q, k, v)
        out = runner.run(batch, q, k, v).clone()
        testing.assert_within(out, expected.float(), TOL, f"replay {i}", batch=batch)
        want = eager.step(q, k, v, builder.build(batch))
        testing.assert_within(out, want, TOL, f"eager {i}", batch=batch)
        for a, b in zip(graphed.caches, eager.caches, strict=True):
            assert torch.equal(a.key, b.key) and torch.equal(a.value, b.value)
    # sizes 4 and 8 for query_len 1 (2 for one or two requests), fewer captures than steps
    assert runner.stats["replays"] == 7
    assert runner.stats["captures"] == len(runner.graphs) < 7


def test_a_first_step_that_is_captured_reads_what_layers_check_once_in_the_warm_up() -> None:
    """Regression (2026-11-26): the tape adaptor recorded a layer's very first call, in which
    the layer reads its fp8 cache's scale values on the host once (they are checked finite and
    non-zero per change, never per step); the recorder refuses host reads, so a runner whose
    first step was captured failed with GraphCaptureError on every step. A device adaptor runs
    the step once before it captures; the tape does too now."""
    spec = replace(SPEC, kv_cache_dtype="fp8_e4m3")
    m = Model(spec)
    runner = m.runner()
    batch = _batch([1, 1, 1], [5, 40, 90], num_blocks=48)
    q, k, v = _step_inputs(spec, batch, seed=3)
    out = runner.run(batch, q, k, v)
    _, expected = testing.reference_after_write(spec, m.caches[1], batch, q, k, v)
    testing.assert_within(out, expected.float(), TOL, "the captured first step", batch=batch)
    assert runner.stats["captures"] == 1


def test_padding_never_touches_the_cache_outside_the_real_slots() -> None:
    model = Model()
    runner = model.runner(capture_sizes=[8])
    batch = _batch([1, 1], [30, 70], num_blocks=48)
    q, k, v = _step_inputs(SPEC, batch, seed=3)
    expected = testing.cache_after_write(model.caches[0], k, v, batch.slot_mapping)
    runner.run(batch, q, k, v)
    assert torch.equal(model.caches[0].key, expected.key)
    assert torch.equal(model.caches[0].value, expected.value)


def test_a_batch_beyond_the_largest_size_is_refused_naming_it_or_run_eagerly() -> None:
    model = Model()
    batch = _batch([1] * 9, [20] * 9, num_blocks=48)
    q, k, v = _step_inputs(SPEC, batch, seed=4)
    with pytest.raises(BatchTooLargeError, match=r"9 tokens.*largest capture size is 8"):
        model.runner().run(batch, q, k, v)
    runner = model.runner(eager_fallback=True)
    _, expected = testing.reference_after_write(SPEC, model.caches[1], batch, q, k, v)
    out = runner.run(batch, q, k, v)
    testing.assert_within(out, expected.float(), TOL, batch=batch)
    assert runner.stats == {"eager": 1}


def test_a_batch_beyond_the_declared_level_is_refused_or_run_eagerly() -> None:
    model = Model()
    batch = _batch([1, 5], [20, 40], num_blocks=48)
    q, k, v = _step_inputs(SPEC, batch, seed=5)
    with pytest.raises(NotCapturableBatchError, match="different query lengths"):
        model.runner().run(batch, q, k, v)
    runner = model.runner(eager_fallback=True)
    _, expected = testing.reference_after_write(SPEC, model.caches[1], batch, q, k, v)
    testing.assert_within(runner.run(batch, q, k, v), expected.float(), TOL, batch=batch)


def test_a_bad_step_is_refused_before_any_replay_and_leaves_the_cache() -> None:
    model = Model()
    runner = model.runner()
    batch = _batch([1, 1], [20, 40], num_blocks=48)
    runner.run(batch, *_step_inputs(SPEC, batch, seed=6))
    before = model.caches[0].clone()
    bad = _batch([1, 1], [20, 40], num_blocks=48)
    bad.block_table_cpu = None
    bad.block_table[1, 2] = 48  # past the cache
    bad.slot_mapping[1] = 48 * BS - 1
    with pytest.raises(InvalidInputError, match="outside the cache"):
        runner.run(bad, *_step_inputs(SPEC, bad, seed=7))
    assert torch.equal(model.caches[0].key, before.key)
    assert runner.stats["replays"] == 1


def test_a_runner_without_the_caches_it_must_check_is_refused() -> None:
    """A replay runs no Python: without ``kv_caches`` nothing would compare a later step's
    slots and blocks with its cache, and one outside it would be written there."""
    model = Model()
    with pytest.raises(InvalidInputError, match=r"GraphRunner\(kv_caches=\[\]\)"):
        model.runner(kv_caches=[])
    with pytest.raises(InvalidInputError, match=r"DcpGraphRunner\(kv_caches=\[\]\)"):
        checked_caches((), "DcpGraphRunner")


def test_every_feature_of_the_torch_backend_replays_correctly() -> None:
    spec = AttentionSpec(
        num_heads=4,
        num_kv_heads=1,
        head_size=32,
        block_size=BS,
        dtype=torch.float32,
        sliding_window=24,
        logits_soft_cap=30.0,
        use_alibi=True,
    )
    backend = TorchBackend(spec, "cpu")
    impl = backend.impl(alibi_slopes=testing.alibi_slopes(4))
    cache = backend.allocate_kv_cache(48)
    testing.fill_cache_random(cache, testing.generator(2))
    runner = GraphRunner(
        backend,
        lambda q, k, v, m: impl.forward(q, k, v, cache, m),
        capture_sizes=[4, 8],
        max_blocks_per_req=8,
        kv_caches=[cache],
    )
    for i, seqs in enumerate([[3, 50, 90], [60, 2], [100, 30, 31, 7]]):
        batch = _batch([2] * len(seqs), seqs, seed=i, num_blocks=48)
        q, k, v = _step_inputs(spec, batch, seed=10 + i)
        _, expected = testing.reference_after_write(
            spec, cache, batch, q, k, v, alibi_slopes=testing.alibi_slopes(4)
        )
        out = runner.run(batch, q, k, v)
        testing.assert_within(out, expected.float(), TOL, f"step {i}", batch=batch)


def test_a_backend_that_never_captures_gets_no_runner() -> None:
    from dataclasses import replace

    class Never(TorchBackend):
        capabilities = replace(TorchBackend.capabilities, graph_capture=GraphSupport.NEVER)

    with pytest.raises(UnsupportedConfigurationError, match="not supported"):
        GraphRunner(
            Never(SPEC, "cpu"),
            lambda *a: None,
            capture_sizes=[4],
            max_blocks_per_req=4,
            kv_caches=[],
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda)")
def test_the_cuda_adaptor_replays_the_torch_backend_on_a_gpu() -> None:
    from attnhub.graphs import CUDAGraphAdaptor

    backend = TorchBackend(SPEC, "cuda")
    impl = backend.impl()
    cache = backend.allocate_kv_cache(48)
    testing.fill_cache_random(cache, testing.generator(3))
    runner = GraphRunner(
        backend,
        lambda q, k, v, m: impl.forward(q, k, v, cache, m),
        capture_sizes=[4, 8],
        max_blocks_per_req=8,
        kv_caches=[cache],
    )
    assert isinstance(runner.adaptor, CUDAGraphAdaptor)
    # Three steps padded to 4 requests (one graph), one to 8 (the second graph).
    steps = [[3, 50, 90], [60, 2, 5], [100, 30, 31, 7], [9, 1, 40, 70, 12]]
    for i, seqs in enumerate(steps):
        batch, _ = testing.make_batch([1] * len(seqs), seqs, BS, 48, seed=i, device="cuda")
        q, k, v = testing.random_qkv(SPEC, batch.num_tokens, testing.generator(i), device="cuda")
        _, expected = testing.reference_after_write(SPEC, cache, batch, q, k, v)
        out = runner.run(batch, q, k, v)
        testing.assert_within(out.cpu(), expected.float(), TOL, f"step {i}", batch=batch)
    assert runner.stats["captures"] == 2


def test_the_torch_backends_level_says_why_it_is_not_higher() -> None:
    """UNIFORM_BATCH with its reason (issue 28: ALWAYS only if the fixed-shape path took
    mixed batches), shown by ``attnhub list`` through the capabilities' summary."""
    caps = TorchBackend.capabilities
    assert caps.graph_capture == GraphSupport.UNIFORM_BATCH
    assert "mixed batch" in caps.graph_capture_reason
    assert caps.summary()["graph_capture_reason"] == caps.graph_capture_reason
