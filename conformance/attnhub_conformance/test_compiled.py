"""A decoder layer calling the backend through ``attnhub.attention``, under ``torch.compile``
(see ``attnhub_conformance.compiled``): one compilation, eager's answers, the cache written in
place."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import pytest
import torch

import attnhub
from attnhub import testing
from attnhub_conformance import compiled as cc
from attnhub_conformance import harness
from attnhub_conformance.cases import Case

#: The words of the op's warning that it was handed a copy of the cache.
COPY_WARNING = "attnhub's op was given other memory than the registered KV cache"


def _setup(case: Case) -> tuple[cc.CompiledRun, list[cc.BatchPlan]]:
    assert case.config is not None
    plans = cc.step_plans(case.target, case.config, case.scope)
    step = harness.prepare_step(case.target, case.config, plans[0], case.id)
    bs = step.spec.block_size
    num_blocks = max(testing.num_blocks_for(p.seq_lens, bs, harness.SPARE_BLOCKS) for p in plans)
    cache = step.backend.allocate_kv_cache(num_blocks)
    testing.fill_cache_random(cache, step.generator)
    twin = cc.twin_cache(step, cache, num_blocks)
    name = f"attnhub_conformance.{case.id}"
    weights = testing.seed_of(case.id)
    eager = cc.DecoderLayer(
        step.spec, step.backend.impl(), twin, name, testing.generator(weights), compiled=False
    )
    impl = step.backend.impl()
    layer = cc.DecoderLayer(step.spec, impl, cache, name, testing.generator(weights), compiled=True)
    attnhub.register_layer(name, impl, cache, replace=True)
    return cc.CompiledRun(step, eager, layer, num_blocks), plans


@pytest.mark.attnhub_cases("compiled")
def test_compiled_decoder_layer_matches_eager(case: Case) -> None:
    from torch._dynamo.testing import CompileCounterWithBackend  # dynamo: seconds to import

    run, plans = _setup(case)
    counter = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    model = torch.compile(run.compiled, fullgraph=True, backend=counter)
    try:
        for i, plan in enumerate(plans):
            _check_step(run, model, plan, f"{case.id}: step {i} ({len(plan.requests)} requests)")
    finally:
        attnhub.unregister_layer(run.compiled.name)
        torch._dynamo.reset()
    assert counter.frame_count == 1, (
        f"{case.id}: the decoder layer compiled {counter.frame_count} times over {len(plans)} "
        "steps of new lengths and batch sizes (the token dimension marked dynamic): once is "
        "what an engine needs"
    )


def _check_step(
    run: cc.CompiledRun, model: Callable[..., tuple[torch.Tensor, ...]], plan: cc.BatchPlan, at: str
) -> None:
    from torch._dynamo.decorators import mark_unbacked

    step = run.step
    batch = cc.batch_for(run, plan)
    meta = step.builder.build(batch)
    x = torch.randn(batch.num_tokens, cc.HIDDEN, generator=step.generator)
    x = x.to(step.device, step.spec.dtype)
    cache = run.compiled.cache
    before = cache.clone()
    with torch.no_grad():
        y_eager, attn_eager, _, _ = run.eager(x, meta=meta)
        shape = (batch.num_tokens, step.spec.num_heads, step.spec.head_size)
        buf = torch.full(shape, math.nan, dtype=step.spec.dtype, device=step.device)
        for t in (x, buf):  # the token count: one graph for every step, one-token steps too
            mark_unbacked(t, 0)
        with warnings.catch_warnings(record=True) as caught, attnhub.forward_context(meta):
            warnings.simplefilter("always")
            y, attn, key, value = model(x, buf)
    n, tol = batch.num_actual_tokens, harness.tolerance(step)
    for what, got, want in (("attention", attn, attn_eager), ("layer", y, y_eager)):
        why = testing.mismatch(got[:n], want[:n].double(), tol, batch if got.dim() == 3 else None)
        assert why is None, f"{at}: the compiled layer's {what} output differs from eager: {why}"
    pad = attn[n:].detach().to("cpu")
    assert bool((pad == 0).all()), f"{at}: compiled padding rows {n}.. must come back as zeros"
    expected = testing.cache_after_write(before, key, value, batch.slot_mapping)
    problems = testing.cache_differences(cache, expected, batch.slot_mapping)
    assert not problems, f"{at}: after the compiled step the KV cache is wrong: " + "; ".join(
        problems
    )
    copied = [str(w.message) for w in caught if COPY_WARNING in str(w.message)]
    assert not copied, f"{at}: the compiled graph handed the backend a copy of the cache: {copied}"
