"""The cheap host paths (docs/performance.md, "Host overhead"): the one-pass check of the usual
layer call accepts exactly what the core's checks accept, with the core's errors; the per-step
plan is the same whether it reads build's numpy facts or the batch; FIA's keyword arguments
are made once per step."""

from __future__ import annotations

import dataclasses
from typing import Any

import ascend_helpers as h
import pytest
import torch
from attnhub_ascend import AscendBackend, emulator
from attnhub_ascend.backend import RESHAPE_AND_CACHE, AscendAttentionImpl

from attnhub import testing
from attnhub.errors import InvalidInputError
from attnhub.spec import AttentionType

MIXED = [(1, 300), (3, 140), (1, 9), (40, 300), (130, 130)]
FIA = "npu_fused_infer_attention_score.out"

Call = dict[str, Any]


def _core_check_forward(impl: AscendAttentionImpl, c: Call) -> object:
    return testing.checked_in_full(impl, lambda: impl.check_forward(**c))


def _warm() -> tuple[h.Step, AscendAttentionImpl, Call]:
    st = h.step(MIXED, padding=3)
    meta = st.backend.metadata_builder().build(st.batch)
    impl = st.backend.impl()
    call: Call = dict(
        query=st.query, key=st.key, value=st.value, cache=st.cache, meta=meta, output=None
    )
    impl.forward(st.query, st.key, st.value, st.cache, meta)  # the memos are filled
    return st, impl, call


def _wrong(st: h.Step, c: Call) -> dict[str, Call]:
    """The core's catalogue of bad layer calls, and Ascend's own: a strided cache (its kernels
    need contiguous planes)."""
    d = st.cache.key.shape[-1]
    doubled = torch.zeros((*st.cache.key.shape[:-1], 2 * d), dtype=st.cache.key.dtype)
    strided = dataclasses.replace(st.cache, key=doubled[..., :d], value=doubled[..., d:])
    return {**testing.bad_layer_calls(st.backend, c), "cache strided": {**c, "cache": strided}}


WRONG = list(_wrong(*_warm()[::2]))  # the names of the bad calls


def test_the_usual_call_takes_the_one_pass_check() -> None:
    """Else the comparisons below would compare the core with itself."""
    st, impl, c = _warm()
    assert impl._usual_call(**c)
    assert impl._usual_call(**{**c, "key": None, "value": None})
    assert impl._usual_call(**{**c, "output": torch.empty_like(st.query)})
    assert impl._usual_step(c["cache"], c["meta"])
    assert impl._usual_kv(st.key, st.value, c["meta"])


@pytest.mark.parametrize("case", [*WRONG, "good", "no new keys"])
def test_forward_checks_accept_and_refuse_exactly_as_the_cores(case: str) -> None:
    st, impl, c = _warm()
    calls = {**_wrong(st, c), "good": c, "no new keys": {**c, "key": None, "value": None}}
    call = calls[case]
    core = testing.call_outcome(lambda: _core_check_forward(impl, call))
    fast = testing.call_outcome(lambda: impl.check_forward(**call))
    assert fast == core
    if case not in ("good", "no new keys"):
        assert core[0] != "ok", f"{case}: the core accepted it, the case tests nothing"


@pytest.mark.parametrize(
    "case", [c for c in WRONG if not c.startswith(("query", "output"))] + ["good", "own slots"]
)
def test_write_kv_meta_checks_accept_and_refuse_exactly_as_the_cores(case: str) -> None:
    st, impl, c = _warm()
    calls = {**_wrong(st, c), "good": c, "own slots": c}
    call = calls[case]
    args = (call["key"], call["value"], call["cache"])
    slots = st.batch.slot_mapping if case == "own slots" else None
    before = call["cache"].clone() if hasattr(call["cache"], "clone") else None
    core = testing.call_outcome(
        lambda: testing.checked_in_full(
            impl, lambda: impl.write_kv(*args, slots, meta=call["meta"])
        )
    )
    fast = testing.call_outcome(lambda: impl.write_kv(*args, slots, meta=call["meta"]))
    assert fast == core
    if case not in ("good", "own slots"):
        assert core[0] != "ok", f"{case}: the core accepted it, the case tests nothing"
        if before is not None:
            assert call["cache"].equal(before)  # a refused write changed nothing


def test_write_kv_with_another_slot_tensor_than_the_steps_is_refused_as_by_the_core() -> None:
    st, impl, c = _warm()
    other = st.batch.slot_mapping.clone()
    outcome = testing.call_outcome(
        lambda: impl.write_kv(st.key, st.value, st.cache, other, meta=c["meta"])
    )
    assert outcome[0] == "InvalidInputError" and "slot_mapping is not meta.batch" in outcome[1]


def test_a_non_causal_step_without_new_keys_passes_the_one_pass_path_too() -> None:
    # forward(q, None, None) after write_kv: the keys are read back from the cache
    s = h.spec(attn_type=AttentionType.ENCODER_ONLY)
    st = h.step([(5, 5), (3, 3)], s)
    meta = st.backend.metadata_builder().build(st.batch)
    impl = st.backend.impl()
    impl.forward(st.query, st.key, st.value, st.cache, meta)
    call: Call = dict(query=st.query, key=None, value=None, cache=st.cache, meta=meta, output=None)
    assert testing.call_outcome(lambda: impl.check_forward(**call))[0] == "ok"


# --- the plan ----------------------------------------------------------------------------------

STEPS: dict[str, tuple[list[tuple[int, int]], int]] = {
    "decodes": ([(1, 300), (1, 9), (1, 129)], 0),
    "decodes, padded": ([(1, 300), (1, 9), (1, 129)], 5),
    "mixed": (MIXED, 0),
    "mixed, padded": (MIXED, 3),
    "fresh one-token prefills": ([(1, 1), (1, 1)], 0),
    "one request": ([(7, 200)], 2),
}


def _fields(meta: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(meta):
        if f.name in ("batch", "extents", "fia_kwargs"):
            continue
        v = getattr(meta, f.name)
        out[f.name] = v.tolist() if isinstance(v, torch.Tensor) else v
    return out


@pytest.mark.parametrize("skip_real", [False, True])
@pytest.mark.parametrize("backend_cls", [AscendBackend, "atb"])
@pytest.mark.parametrize("name", list(STEPS))
def test_the_plan_from_builds_facts_is_the_plan_from_the_batch(
    name: str, backend_cls: Any, skip_real: bool
) -> None:
    """plan reads the lengths build's checks found (numpy) and shortcuts one-token query ends;
    planning from the batch alone (no facts: structural checks) gives the same step."""
    requests, padding = STEPS[name]
    st = h.step(requests, padding=padding)
    if skip_real:
        st.batch.slot_mapping[0] = -1  # an engine may mark a real token's write as skipped
    backend = st.backend
    if backend_cls == "atb":
        backend = type("Atb", (AscendBackend,), {"kv_write_op": RESHAPE_AND_CACHE})(
            st.backend.spec, "cpu", emulate=True
        )
    builder = backend.metadata_builder()
    meta = builder.build(st.batch)
    structural = backend.metadata_builder()
    structural.checks = "structural"
    assert structural.check_step(st.batch).facts.seq_lens is None  # nothing read: plan reads
    again = structural.build(st.batch)
    assert _fields(meta) == _fields(again)
    assert again.extents is not None and again.extents.max_slot == -1
    # and the step's lists are the batch's own
    assert list(meta.query_ends) == st.batch.query_start_loc_cpu[1:].tolist()
    assert list(meta.kv_lengths) == st.batch.seq_lens_cpu.tolist()
    n = st.batch.num_actual_tokens
    written = [s for s in st.batch.slot_mapping[:n].tolist() if s >= 0 or backend_cls == "atb"]
    assert meta.slot_mapping.tolist() == written


# --- FIA's keyword arguments ----------------------------------------------------------------------


def test_fia_arguments_are_made_by_build_once_per_step_and_only_read() -> None:
    st = h.step(MIXED)
    meta = st.backend.metadata_builder().build(st.batch)
    made = dict(meta.fia_kwargs)  # complete when build returns
    assert made["actual_seq_lengths"] == meta.query_ends
    assert made["actual_seq_lengths_kv"] == meta.kv_lengths
    layers = [st.backend.impl() for _ in range(3)]
    with emulator.record_calls() as calls:
        for impl in layers:
            impl.forward(st.query, st.key, st.value, st.cache, meta)
    fia = [c for c in calls if c.name == FIA]
    assert len(fia) == 3
    assert all(c.kwargs["actual_seq_lengths"] == meta.query_ends for c in fia)
    assert meta.fia_kwargs == made and all(meta.fia_kwargs[k] is v for k, v in made.items())


@pytest.mark.parametrize(
    "requests",
    [
        [(1, 200), (1, 30), (1, 41), (1, 40)],  # decodes only: the one-token shortcut
        [(1, 200), (1, 30), (6, 100), (1, 300), (40, 40)],
        [(3, 200), (1, 41)],
    ],
)
def test_window_padding_rows_read_their_token_and_come_first(
    requests: list[tuple[int, int]],
) -> None:
    st = h.step(requests, h.spec(sliding_window=40), padding=2)
    meta = st.backend.metadata_builder().build(st.batch)
    q_lens = [q for q, _ in requests]
    padded = [q == 1 and s > 40 for q, s in requests]
    assert meta.query_rows is not None and meta.output_rows is not None
    src, dst = meta.query_rows.tolist(), meta.output_rows.tolist()
    n = sum(q_lens)
    assert meta.kernel_tokens == len(src) == n + sum(padded)
    assert [src[d] for d in dst] == list(range(n))  # every token's output row reads it
    starts = st.batch.query_start_loc_cpu[:-1].tolist()
    for r, t in enumerate(starts):  # the padding row right before a padded token reads it
        if padded[r]:
            assert dst[t] >= 1 and src[dst[t] - 1] == t
    ends, rows = [], 0
    for q, p in zip(q_lens, padded, strict=True):
        rows += q + p
        ends.append(rows)
    assert list(meta.query_ends) == ends
    h.assert_matches_reference(
        st, st.backend.impl().forward(st.query, st.key, st.value, st.cache, meta)
    )


def test_a_cache_whose_plane_was_replaced_is_checked_again() -> None:
    """The one-pass test keys on the planes of the last accepted cache, as the core's memo."""
    st, impl, c = _warm()
    d = st.cache.key.shape[-1]
    doubled = torch.zeros((*st.cache.key.shape[:-1], 2 * d), dtype=st.cache.key.dtype)
    st.cache.key = doubled[..., :d]  # PagedKVCache is mutable: same object, strided plane
    assert not impl._usual_call(**c)
    with pytest.raises(InvalidInputError, match="contiguous"):
        impl.forward(st.query, st.key, st.value, st.cache, c["meta"])


def test_another_cache_goes_through_the_cores_checks_once() -> None:
    st, impl, c = _warm()
    other = st.backend.allocate_kv_cache(40)  # another layer's cache, the same geometry
    assert not impl._usual_call(**{**c, "cache": other})
    impl.forward(st.query, st.key, st.value, other, c["meta"])  # accepted by the core
    assert impl._usual_call(**{**c, "cache": other}) and not impl._usual_call(**c)
    impl.forward(st.query, st.key, st.value, st.cache, c["meta"])
    assert impl._usual_call(**c)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("atb", [False, True])
def test_write_kv_with_a_strided_slot_tensor_of_its_own(atb: bool, dtype: torch.dtype) -> None:
    st = h.step([(5, 5)])
    backend = st.backend
    if atb:
        backend = type("Atb", (AscendBackend,), {"kv_write_op": RESHAPE_AND_CACHE})(
            st.backend.spec, "cpu", emulate=True
        )
    wide = torch.full((10,), -1, dtype=dtype)
    wide[::2] = torch.tensor([3, 9, 130, 8, 7])
    backend.impl().write_kv(st.key, st.value, st.cache, wide[::2])
    flat_k = st.cache.key.view(-1, *st.cache.key.shape[2:])
    for row, slot in enumerate((3, 9, 130, 8, 7)):
        assert torch.equal(flat_k[slot], st.key[row])


def test_a_graph_capture_plans_its_own_batch_not_the_last_builds() -> None:
    builder = h.backend().metadata_builder()
    builder.build(h.step(MIXED).batch)  # another step's facts, taken by its plan
    capture = h.step([(1, 300), (1, 9), (1, 129)]).batch
    meta = builder.build_for_graph_capture(capture)
    assert meta.query_ends == (1, 2, 3) and meta.kv_lengths == (300, 9, 129)
