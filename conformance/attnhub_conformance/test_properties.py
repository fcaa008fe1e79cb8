"""Random batch compositions within the declared capabilities match the reference.

Hypothesis draws the configuration (dtype, head size, head layout, block size, KV format,
attention type, features) and the batch (requests of every declared kind, padding); each example
checks the output against the reference and the cache against the reference's write.
``--attnhub-hypothesis-examples N`` sets how many examples (default 15).

The draws are seeded, never left to chance: ``--attnhub-hypothesis-seed N`` (default 0) fixes
them, so a run that passed passes again and a failure fails the same way on every rerun; each
backend's case draws from a seed of its own made from N and the case id. ``random`` draws a
fresh N per session and names it (at the end of the run, and in a failure), for exploratory runs
that look for new failures. Hypothesis keeps no example database (``database=None``), so nothing
from an earlier run changes what a run draws.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, seed, settings
from hypothesis import strategies as st

from attnhub import testing
from attnhub.spec import AttentionType
from attnhub_conformance import harness
from attnhub_conformance.cases import Axes, BatchPlan, Case, Config


@st.composite
def step_plans(draw: st.DrawFn, axes: Axes) -> tuple[Config, BatchPlan]:
    base = axes.base
    assert base is not None
    caps = axes.caps
    attn = draw(st.sampled_from([base.attn_type, *axes.attn_types]))
    config = Config(
        dtype=draw(st.sampled_from(axes.dtypes)),
        head_size=draw(st.sampled_from(axes.head_sizes)),
        heads=draw(st.sampled_from(axes.heads)),
        block_size=draw(st.sampled_from(axes.block_sizes)),
        kv_cache_dtype=draw(st.sampled_from([base.kv_cache_dtype, *axes.kv_cache_dtypes])),
        attn_type=attn,
        features=tuple(f for f in axes.features if draw(st.booleans())),
    )
    assume(axes.supports(config))
    bs = config.block_size
    kinds = ["decode", "prefill"]
    if caps.chunked_prefill:
        kinds.append("chunked_prefill")
    if caps.multi_token_decode:
        kinds.append("multi_token_decode")
    requests = []
    for _ in range(draw(st.integers(1, 10))):
        if attn is AttentionType.ENCODER_DECODER:
            q = draw(st.integers(1, 12))
            requests.append((q, q + draw(st.integers(0, 3 * bs))))
            continue
        kind = "prefill" if not attn.is_causal else draw(st.sampled_from(kinds))
        if kind == "prefill":
            n = draw(st.integers(1, 3 * bs + 5))
            requests.append((n, n))
        else:
            q = {
                "decode": 1,
                "multi_token_decode": draw(st.integers(2, 4)),
                "chunked_prefill": draw(st.integers(2, 2 * bs + 3)),
            }[kind]
            requests.append((q, q + draw(st.integers(1, 4 * bs + 7))))
    new_kv = attn is not AttentionType.ENCODER_DECODER
    padding = draw(st.integers(0, 4)) if new_kv else 0
    return config, BatchPlan(tuple(requests), padding=padding, new_kv=new_kv)


@pytest.mark.attnhub_cases("properties")
def test_random_batches_match_reference(
    case: Case, attnhub_hypothesis_examples: int, attnhub_hypothesis_seed: int
) -> None:
    axes = Axes(case.target, case.scope)
    counter = iter(range(10**9))

    @seed(testing.seed_of(f"{attnhub_hypothesis_seed}/{case.id}"))
    @settings(
        max_examples=attnhub_hypothesis_examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    @given(drawn=step_plans(axes))
    def check(drawn: tuple[Config, BatchPlan]) -> None:
        config, plan = drawn
        label = f"{case.id}[example {next(counter)}: {config.id} {plan.requests}]"
        step = harness.prepare_step(case.target, config, plan, label)
        layer = step.layers[0]
        before = layer.cache.clone()
        out = step.forward(layer)
        harness.assert_matches_reference(step, layer, out)
        if plan.new_kv:
            slots = step.batch.slot_mapping
            expected = testing.cache_after_write(before, layer.key, layer.value, slots)
            problems = testing.cache_differences(layer.cache, expected, slots)
            assert not problems, f"{label}: the cache is wrong: " + "; ".join(problems)

    try:
        check()
    except Exception as exc:
        add_note = getattr(exc, "add_note", None)  # Python >= 3.11; the run's summary says it too
        if add_note is not None:
            add_note(
                f"{case.id}: drawn with --attnhub-hypothesis-seed {attnhub_hypothesis_seed} "
                "(the same option and value draw these examples again)"
            )
        raise
