"""attnhub-speedups' compiled pass (``validation.FAST_STEP``) held to the Python rules
(``validation.STEP``): on any step, valid or spoiled, the pass clears it exactly where the rules
do, and then with the very facts and arrays the rules return. Also: the pass stays out of the
way where it is off or where a step is unusual (the rules decide), and its arrays are read from
the batch on first use, once. Then its structure pass (C++, below)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnhub import validation
from attnhub.batch import BatchMetadata
from attnhub.errors import InvalidInputError
from attnhub.spec import AttentionSpec

pytest.importorskip(
    "attnhub_speedups",
    reason="attnhub-speedups (the optional C extension, ./speedups) is not installed here; "
    "nox installs it, so CI runs these tests",
)

CPU = torch.device("cpu")
I32, I64 = np.iinfo(np.int32), np.iinfo(np.int64)
ARRAYS = ("query_lens", "seq_lens", "context_lens", "query_start_locs", "block_table")
SCALARS = ("max_slot", "max_block", "min_slot", "min_query_len", "min_context_len")


@pytest.fixture(autouse=True)
def _restored() -> Any:
    """Each test leaves the pass as it found it (on, or off under ``ATTNHUB_SPEEDUPS=0``)."""
    was = validation.speedups_in_use()
    yield
    validation.use_speedups(was)


def _spec(block_size: int) -> AttentionSpec:
    return AttentionSpec(
        num_heads=2, num_kv_heads=1, head_size=8, dtype=torch.float32, block_size=block_size
    )


def _python(batch: BatchMetadata, spec: AttentionSpec) -> Any:
    """The rules' verdict: their facts, or the exception they raise (any kind: a step numpy
    cannot reduce raises ValueError, the pass must not clear it either)."""
    try:
        return validation.STEP.passes(batch, spec, CPU) or validation.STEP.explain(batch, spec, CPU)
    except Exception as exc:
        return exc


def _assert_same_facts(fast: validation.StepFacts, slow: validation.StepFacts) -> None:
    for name in SCALARS:
        assert getattr(fast, name) == getattr(slow, name), name
    for name in ARRAYS:
        a, b = getattr(fast, name), getattr(slow, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(a, b, err_msg=name)


def _assert_agree(batch: BatchMetadata, spec: AttentionSpec) -> bool:
    """The pass clears ``batch`` exactly where the rules do, with the same facts; and
    ``check_step`` with and without it raises the same error or returns equal facts. Whether
    the step passes."""
    slow = _python(batch, spec)
    fast = validation.FAST_STEP.passes(batch, spec, CPU)
    if isinstance(slow, Exception):
        assert fast is False, f"the pass cleared a step the rules refuse: {slow!r}"
        assert validation.use_speedups(True)
        with pytest.raises(type(slow)) as raised:
            validation.check_step(spec, batch, CPU)
        assert str(raised.value) == str(slow)
        return False
    assert fast is not False, f"the pass refused a step the rules clear: {slow}"
    _assert_same_facts(fast, slow)
    assert validation.use_speedups(True)
    _assert_same_facts(validation.check_step(spec, batch, CPU), slow)
    return True


# --- steps: valid ones, then spoiled -------------------------------------------------------------

INT = st.sampled_from([np.int32, np.int64])


@st.composite
def valid_steps(draw: st.DrawFn) -> dict[str, Any]:
    """A valid step as numpy arrays and scalars (dtypes drawn per array)."""
    B = draw(st.integers(0, 6))
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    qlens = np.array(draw(st.lists(st.integers(1, 6), min_size=B, max_size=B)), np.int64)
    ctx = np.array(draw(st.lists(st.integers(0, 40), min_size=B, max_size=B)), np.int64)
    seq = ctx + qlens
    need = int((-(-seq // bs)).max()) if B else 0
    width = need + draw(st.integers(0, 2))
    total = int(qlens.sum())
    pad = draw(st.integers(0, 3))
    written = draw(st.lists(st.integers(0, 500), min_size=total, max_size=total, unique=True))
    entries = written + [-1] * pad  # padding at the end, as engines have it, or anywhere
    slots = np.array(draw(st.permutations(entries)) if draw(st.booleans()) else entries, np.int64)
    table = np.array(
        draw(st.lists(st.integers(0, 300), min_size=B * width, max_size=B * width)), np.int64
    ).reshape(B, width)
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int64)
    return dict(
        qsl=np.asarray(qsl, draw(INT)),
        seq=np.asarray(seq, draw(INT)),
        slots=np.asarray(slots, draw(INT)),
        table=np.asarray(table, draw(INT)),
        block_size=bs,
        num_actual_tokens=total,
        max_query_len=int(qlens.max()) if B else 0,
        max_seq_len=int(seq.max()) if B else 0,
        host_copies=draw(st.booleans()),
    )


def _batch(s: dict[str, Any]) -> BatchMetadata:
    def t(a: Any) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a))

    qsl, seq, table, slots = t(s["qsl"]), t(s["seq"]), t(s["table"]), t(s["slots"])
    return BatchMetadata(
        query_start_loc=qsl.clone(),
        query_start_loc_cpu=qsl,
        seq_lens=seq.clone(),
        seq_lens_cpu=seq,
        num_reqs=len(s["seq"]),
        num_actual_tokens=s["num_actual_tokens"],
        max_query_len=s["max_query_len"],
        max_seq_len=s["max_seq_len"],
        block_table=table.clone() if s["host_copies"] else table,
        slot_mapping=slots.clone() if s["host_copies"] else slots,
        block_size=s["block_size"],
        block_table_cpu=table if s["host_copies"] else None,
        slot_mapping_cpu=slots if s["host_copies"] else None,
    )


def _set(s: dict[str, Any], key: str, i: int, value: int) -> None:
    """``s[key]`` (flat index ``i``) = ``value``, the array widened to int64 where it does not
    hold it."""
    a = s[key]
    value = (value + 2**63) % 2**64 - 2**63  # as int64 holds it
    info = np.iinfo(a.dtype)
    if not info.min <= value <= info.max:
        a = a.astype(np.int64)
    a = a.copy()
    a.reshape(-1)[i] = value
    s[key] = a


EXTREMES = [I32.min, I32.min + 1, I32.max, I32.max - 1, I64.min, I64.min + 1, I64.max, -2, -1]


def _spoil(s: dict[str, Any], how: str, data: st.DataObject) -> None:
    """Break (or stress) one rule of the step ``s`` in place."""
    B, n = len(s["seq"]), len(s["slots"])
    r = data.draw(st.integers(0, max(B - 1, 0)))
    k = data.draw(st.integers(0, max(n - 1, 0)))
    if how == "qsl0" and B:
        s["qsl"] = s["qsl"] + data.draw(st.sampled_from([-1, 1, 2]))
    elif how == "query len < 1" and B:
        _set(s, "qsl", r + 1, int(s["qsl"][r]) - data.draw(st.integers(0, 2)))
    elif how == "seq < query" and B:
        _set(s, "seq", r, int(s["qsl"][r + 1] - s["qsl"][r]) - data.draw(st.integers(1, 3)))
    elif how == "num_actual_tokens":
        s["num_actual_tokens"] += data.draw(st.sampled_from([-1, 1]))
    elif how == "slot mapping short" and n:
        s["slots"] = s["slots"][: data.draw(st.integers(0, n - 1))]
    elif how == "table narrow" and s["table"].shape[1]:
        s["table"] = s["table"][:, : data.draw(st.integers(0, s["table"].shape[1] - 1))]
    elif how == "max_query_len":
        s["max_query_len"] += data.draw(st.sampled_from([-1, 1]))
    elif how == "max_seq_len":
        s["max_seq_len"] += data.draw(st.sampled_from([-1, 1]))
    elif how == "slot below -1" and n:
        _set(s, "slots", k, data.draw(st.sampled_from([-2, -7, int(I32.min), int(I64.min)])))
    elif how == "duplicate slot" and n > 1:
        j = data.draw(st.integers(0, n - 1))
        _set(s, "slots", j, int(s["slots"][k]))
    elif how == "negative block" and s["table"].size:
        i = data.draw(st.integers(0, s["table"].size - 1))  # read by a request or not
        _set(s, "table", i, data.draw(st.sampled_from([-1, -5, int(I32.min), int(I64.min)])))
    elif how == "huge entry":
        key = data.draw(st.sampled_from(["qsl", "seq", "slots", "table"]))
        if s[key].size:
            i = data.draw(st.integers(0, s[key].size - 1))
            _set(s, key, i, data.draw(st.sampled_from(EXTREMES)))
    elif how == "huge scalar":
        key = data.draw(st.sampled_from(["num_actual_tokens", "max_query_len", "max_seq_len"]))
        s[key] = data.draw(st.sampled_from([*EXTREMES, 2**70, -(2**70)]))


SPOILERS = [
    "qsl0",
    "query len < 1",
    "seq < query",
    "num_actual_tokens",
    "slot mapping short",
    "table narrow",
    "max_query_len",
    "max_seq_len",
    "slot below -1",
    "duplicate slot",
    "negative block",
    "huge entry",
    "huge scalar",
]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=valid_steps(), spoilers=st.lists(st.sampled_from(SPOILERS), max_size=3), data=st.data())
def test_the_compiled_pass_agrees_with_the_rules(
    step: dict[str, Any], spoilers: list[str], data: st.DataObject
) -> None:
    for how in spoilers:
        _spoil(step, how, data)
    spec = _spec(step["block_size"])
    passed = _assert_agree(_batch(step), spec)
    if not spoilers:
        assert passed  # a valid step passes both ways


def _wrapped(values: list[int], dtype: Any) -> np.ndarray:
    return np.array(values, np.int64).astype(dtype)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_compiled_pass_agrees_at_the_dtypes_limits(data: st.DataObject) -> None:
    """Offsets and lengths near the dtypes' limits (where an int32 difference would wrap; the
    rules take lengths in int64, where int64 data still wraps as numpy does): the lengths drawn
    from extremes and small numbers, with the step's scalars computed as the rules compute
    them, so that some of these steps pass."""
    B = data.draw(st.integers(1, 4))
    pick = st.one_of(st.integers(-3, 9), st.sampled_from(EXTREMES))
    qdt, sdt = data.draw(INT), data.draw(INT)
    qsl = _wrapped(data.draw(st.lists(pick, min_size=B + 1, max_size=B + 1)), qdt)
    seq = _wrapped(data.draw(st.lists(pick, min_size=B, max_size=B)), sdt)
    if data.draw(st.booleans()):
        qsl[0] = 0
    qlens = np.subtract(qsl[1:], qsl[:-1], dtype=np.int64)  # as the rules take them
    bs = data.draw(st.sampled_from([1, 4]))
    width = data.draw(st.integers(0, 3))
    total = int(qsl[-1])
    n = data.draw(st.integers(0, 6))
    step = dict(
        qsl=qsl,
        seq=seq,
        slots=np.arange(n, dtype=data.draw(INT)),
        table=np.zeros((B, width), data.draw(INT)),
        block_size=bs,
        num_actual_tokens=total if data.draw(st.booleans()) else min(total, n),
        max_query_len=int(qlens.max()),
        max_seq_len=int(seq.max()),
        host_copies=True,
    )
    _assert_agree(_batch(step), _spec(bs))


def _step(qsl: Any, seq: Any, table: Any, block_size: int, **scalars: Any) -> dict[str, Any]:
    """A step from its arrays, its scalars as the rules compute them unless given."""
    qlens = np.subtract(qsl[1:], qsl[:-1], dtype=np.int64)
    return dict(
        qsl=qsl,
        seq=seq,
        slots=scalars.pop("slots", np.arange(int(qsl[-1]) if 0 <= qsl[-1] <= 64 else 0)),
        table=table,
        block_size=block_size,
        num_actual_tokens=scalars.pop("num_actual_tokens", int(qsl[-1])),
        max_query_len=scalars.pop("max_query_len", int(qlens.max())),
        max_seq_len=scalars.pop("max_seq_len", int(seq.max())),
        host_copies=True,
    )


_32, _64 = np.int32, np.int64
#: Steps at the edges of the rules' arithmetic, and whether the rules clear them.
EDGES = {
    # int32 offsets whose int32 differences would wrap (to query lengths [2**31 - 1, 1]) and
    # sequence lengths of -2**31 (contexts >= 0 in int32): lengths are taken in int64, refused
    # (a regression: both were accepted)
    "query lengths would wrap in int32": (
        _step(
            np.array([0, I32.max, I32.min], _32), np.array([I32.min, I32.min], _32),
            np.zeros((2, 1), _32), 4,
        ),
        False,
    ),
    # the same offsets in int64 do not wrap: a negative query length
    "query lengths in int64": (
        _step(
            np.array([0, I32.max, I32.min], _64), np.array([I32.min, I32.min], _32),
            np.zeros((2, 1), _32), 4,
        ),
        False,
    ),
    # a uniform step's shortest context is min(seq) - max query, in Python ints: no wrap
    "uniform step's context": (
        _step(np.array([0, 1, 2], _32), np.array([I32.min, 5], _32), np.zeros((2, 2), _32), 4),
        False,
    ),
    # a negative entry no request reads (row 0 reads 1 block of 4)
    "negative unread block": (
        _step(np.array([0, 1, 2], _32), np.array([3, 9], _64),
              np.array([[7, -1, -5], [1, 2, 3]], _32), 4, slots=np.array([0, 1])),
        True,
    ),
    "negative read block": (
        _step(np.array([0, 1, 2], _32), np.array([5, 9], _64),
              np.array([[7, -1, -5], [1, 2, 3]], _32), 4, slots=np.array([0, 1])),
        False,
    ),
    # a negative sequence length: its context (seq - query len, in int64) is negative
    "negative sequence length": (
        _step(np.array([0, 1, 3], _32), np.array([I32.min, I32.min], _32),
              np.full((2, 1), -3, _64), 4),
        False,
    ),
    # int32 offsets, int64 sequence lengths: a negative context
    "int64 sequence lengths": (
        _step(np.array([0, 1, 3], _32), np.array([I32.min, I32.min], _64),
              np.full((2, 1), -3, _64), 4),
        False,
    ),
    "padding and a duplicate slot": (
        _step(np.array([0, 1, 3], _64), np.array([1, 2], _64), np.zeros((2, 1), _32), 4,
              slots=np.array([5, -1, 9, -1, 5], _32)),
        False,
    ),
    "padding only": (
        _step(np.array([0, 1], _64), np.array([1], _64), np.zeros((1, 1), _32), 4,
              slots=np.array([-1, -1, -1], _64), num_actual_tokens=1),
        True,
    ),
    # no request: the rules compare no length with max_query_len, however large (a regression:
    # the pass refused it, found by the hypothesis test above)
    "max_query_len beyond int64, no request": (
        dict(qsl=np.array([0], _32), seq=np.array([], _32), slots=np.array([], _32),
             table=np.zeros((0, 0), _32), block_size=1, num_actual_tokens=0,
             max_query_len=2**70, max_seq_len=-(2**70), host_copies=False),
        True,
    ),
    # max_query_len beyond int64: the pass cannot take it, the rules refuse it
    "max_query_len beyond int64": (
        _step(np.array([0, 1], _64), np.array([1], _64), np.zeros((1, 1), _32), 4,
              slots=np.array([0]), max_query_len=2**64 + 1),
        False,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(EDGES))
def test_the_compiled_pass_agrees_at_the_edges(name: str) -> None:
    step, passes = EDGES[name]
    assert _assert_agree(_batch(step), _spec(step["block_size"])) == passes


# --- the pass's place ---------------------------------------------------------------------------


def _good(**changes: Any) -> BatchMetadata:
    table = torch.arange(1, 13, dtype=torch.int32).view(3, 4)
    batch = BatchMetadata.from_lengths([1, 5, 1], [20, 9, 33], table, 16, num_tokens=9)
    return dataclasses.replace(batch, **changes)


def test_a_strided_host_copy_is_left_to_the_rules() -> None:
    """The pass reads dense buffers only: a strided host copy does not pass it, and the rules
    decide (here: the step is valid)."""
    batch = _good()
    wide = torch.stack([batch.slot_mapping, batch.slot_mapping], 1)
    strided = _good(slot_mapping=batch.slot_mapping, slot_mapping_cpu=wide[:, 0])
    assert strided.slot_mapping_cpu is not None
    assert not strided.slot_mapping_cpu.is_contiguous()
    spec = _spec(16)
    assert validation.FAST_STEP.passes(strided, spec, CPU) is False
    assert validation.use_speedups(True)
    _assert_same_facts(validation.check_step(spec, strided, CPU), _python(batch, spec))


def test_a_refused_step_is_worded_by_the_rules() -> None:
    slots = _good().slot_mapping.clone()
    slots[4] = slots[2]
    assert validation.use_speedups(True)
    with pytest.raises(InvalidInputError, match=r"slot_mapping\[2\] and slot_mapping\[4\]"):
        validation.check_step(_spec(16), _good(slot_mapping=slots), CPU)


def test_the_arrays_are_read_on_first_use_once() -> None:
    batch = _good()
    facts = validation.FAST_STEP.passes(batch, _spec(16), CPU)
    assert isinstance(facts, validation.StepFacts)
    for name in ARRAYS:  # nothing read yet: the slots are empty
        with pytest.raises(AttributeError):
            validation.StepFacts.__dict__[name].__get__(facts)
    first = facts.context_lens
    assert first is facts.context_lens and facts.query_lens is facts.query_lens
    assert facts.block_table is not None and facts.block_table.shape == (3, 4)
    _assert_same_facts(facts, _python(batch, _spec(16)))


def test_a_step_without_requests_has_no_arrays() -> None:
    empty = BatchMetadata.from_lengths([], [], torch.zeros(0, 1, dtype=torch.int32), 16)
    facts = validation.FAST_STEP.passes(empty, _spec(16), CPU)
    assert facts is not False
    assert all(getattr(facts, name) is None for name in ARRAYS)
    _assert_same_facts(facts, _python(empty, _spec(16)))


def test_use_speedups_switches_the_pass() -> None:
    try:
        assert not validation.use_speedups(False)
        assert not validation.speedups_in_use()
        assert type(validation.check_step(_spec(16), _good(), CPU)) is validation.StepFacts
    finally:
        assert validation.use_speedups(True)
    assert validation.speedups_available() and validation.speedups_in_use()
    assert type(validation.check_step(_spec(16), _good(), CPU)) is not validation.StepFacts


def test_attnhub_speedups_0_turns_it_off() -> None:
    """Both passes (the structure pass where it is built here)."""
    code = (
        "from attnhub import validation as v; "
        "print(v.speedups_available(), v.speedups_in_use(), v.structure_pass_in_use())"
    )
    built = validation._compiled_step_structure is not None
    for value, expected in (("0", "True False False"), ("1", f"True True {built}")):
        env = dict(os.environ, ATTNHUB_SPEEDUPS=value)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.split() == expected.split()


def test_the_host_bench_times_build_with_and_without_the_pass() -> None:
    from attnhub import bench

    row = bench.host_overhead("decode x1", backend="torch")
    assert row.build_us > 0 and row.build_python_us is not None and row.build_python_us > 0
    assert validation.speedups_in_use()  # switched back on after timing the Python rules


# --- the structure pass (C++, built against torch) ----------------------------------------------
# attnhub-speedups' ``_step_structure`` held to the Python rules (``validation.STRUCTURE`` and
# ``dense_batch``): it clears a batch only where the rules do and the batch is dense, and clears
# every plain sound batch (it may refuse what it does not read as Python would: tensor
# subclasses, lengths that are not ints). A builder's checks with the pass and without it return
# the same dense batch and facts, or raise the same error. It is used only with the torch it was
# built against.

structure_pass = pytest.mark.skipif(
    validation._compiled_step_structure is None,
    reason="attnhub-speedups' structure pass is not built here: "
    f"{validation.STRUCTURE_PASS_MISSING} (nox builds it, so CI runs these tests)",
)
_DENSE_FIELDS = validation._DENSE_FIELDS


class _Traced(torch.Tensor):
    """A tensor subclass (its own ``__torch_function__`` could answer attribute reads its way)."""


class _Batch(BatchMetadata):
    """A subclass of BatchMetadata (it could redefine a field as a property)."""


@st.composite
def sound_batches(draw: st.DrawFn) -> BatchMetadata:
    """A sound dense batch on the host: lengths drawn, host copies of the table and slots or
    not, int32 or int64 tensors."""
    B = draw(st.integers(0, 5))
    qlens = draw(st.lists(st.integers(1, 4), min_size=B, max_size=B))
    seq = [q + draw(st.integers(0, 30)) for q in qlens]
    bs = draw(st.sampled_from([1, 4, 16]))
    width = max([-(-s // bs) for s in seq], default=0) + draw(st.integers(0, 2))
    table = torch.arange(B * width, dtype=torch.int32).view(B, width)
    batch = BatchMetadata.from_lengths(
        qlens, seq, table, bs, num_tokens=sum(qlens) + draw(st.integers(0, 2))
    )
    int_type = st.sampled_from([torch.int32, torch.int64])
    if draw(st.booleans()):  # host copies of the table and the slots (else None)
        batch = dataclasses.replace(
            batch,
            block_table_cpu=batch.block_table.clone(),
            slot_mapping_cpu=batch.slot_mapping.clone(),
        )
    changes: dict[str, Any] = {
        name: getattr(batch, name).to(draw(int_type))
        for name in _DENSE_FIELDS
        if getattr(batch, name) is not None
    }
    return dataclasses.replace(batch, **changes)


def _strided(t: torch.Tensor) -> torch.Tensor:
    return torch.stack([t, t], -1)[..., 0]  # the same values, every other entry of a buffer


#: Ways to break (or bend) a batch's structure: a tensor field replaced.
TENSOR_CHANGES = {
    "float32": lambda t: t.float(),
    "int16": lambda t: t.to(torch.int16),
    "uint8": lambda t: t.to(torch.uint8),
    "bool": lambda t: t.bool(),
    "one entry fewer": lambda t: t[:-1] if t.ndim == 1 else t[:, :-1],
    "one row fewer": lambda t: t[1:],
    "one more dimension": lambda t: t.unsqueeze(0),
    "flattened": lambda t: t.reshape(-1),
    "strided": _strided,
    "nested": lambda t: torch.nested.nested_tensor([t]),
    "on meta": lambda t: t.to("meta"),
    "subclass": lambda t: t.as_subclass(_Traced),
    "None": lambda t: None,
    "a list": lambda t: t.tolist(),
}


def _as_numpy(v: Any) -> Any:
    """``v`` as a numpy int64 where it fits one (a value beyond int64 is left as it is)."""
    return np.int64(v) if -(2**63) <= v < 2**63 else v


#: ... or a scalar field.
SCALAR_CHANGES = {
    "num_reqs + 1": ("num_reqs", lambda v: v + 1),
    "num_reqs - 1": ("num_reqs", lambda v: v - 1),
    "num_reqs as numpy": ("num_reqs", _as_numpy),
    "num_reqs as float": ("num_reqs", lambda v: float(v)),
    "num_reqs beyond int64": ("num_reqs", lambda v: int(v) + 2**70),
    "block_size + 1": ("block_size", lambda v: v + 1),
    "block_size as numpy": ("block_size", _as_numpy),
    "num_actual_tokens + 1": ("num_actual_tokens", lambda v: v + 1),
    "num_actual_tokens as numpy": ("num_actual_tokens", _as_numpy),
}
#: Changes the pass may refuse although the rules clear them (it reads them not as Python
#: does): it must then leave the batch to the rules.
CAUTIOUS = {
    "subclass",
    "nested",
    "num_reqs as numpy",
    "num_reqs as float",
    "block_size as numpy",
    "num_actual_tokens as numpy",
}


def _verdict(fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:  # the rules' own error, or what Python raised on the way
        return exc


def _same(a: Any, b: Any) -> None:
    if isinstance(b, Exception):
        assert type(a) is type(b) and str(a) == str(b), (a, b)
        return
    assert not isinstance(a, Exception), a
    (batch_a, facts_a), (batch_b, facts_b) = a, b
    for name in _DENSE_FIELDS:
        x, y = getattr(batch_a, name), getattr(batch_b, name)
        assert x is y or (x is not None and y is not None and torch.equal(x, y)), name
    assert type(facts_a) is type(facts_b) or validation.StepFacts in (
        type(facts_a).__mro__[1:] + type(facts_b).__mro__[1:]
    )
    for name in ("max_slot", "max_block", "min_slot", "min_query_len", "min_context_len"):
        assert getattr(facts_a, name) == getattr(facts_b, name), name


@structure_pass
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=sound_batches(),
    changes=st.lists(
        st.tuples(st.sampled_from(_DENSE_FIELDS), st.sampled_from(sorted(TENSOR_CHANGES)))
        | st.tuples(st.just(""), st.sampled_from(sorted(SCALAR_CHANGES))),
        max_size=2,
    ),
    device=st.sampled_from([CPU, torch.device("cpu", 0), torch.device("meta")]),
    subclass=st.booleans(),
    spec_block_size=st.sampled_from([None, 1, 16]),
)
def test_the_structure_pass_agrees_with_the_rules(
    batch: BatchMetadata,
    changes: list[tuple[str, str]],
    device: torch.device,
    subclass: bool,
    spec_block_size: int | None,
) -> None:
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    for name, how in changes:
        if name:
            if isinstance(fields[name], torch.Tensor) and not fields[name].is_nested:
                fields[name] = TENSOR_CHANGES[how](fields[name])
        else:
            field, change = SCALAR_CHANGES[how]
            fields[field] = change(fields[field])
    batch = (_Batch if subclass else BatchMetadata)(**fields)
    spec = _spec(int(batch.block_size) if spec_block_size is None else spec_block_size)
    cautious = subclass or any(how in CAUTIOUS for _, how in changes)

    fast = validation._compiled_step_structure(batch, spec.block_size, device)
    dense = validation.dense_batch(batch)
    slow = _verdict(lambda: validation.check_structure(spec, dense, device))
    sound = slow is validation.STRUCTURAL_FACTS and dense is batch
    if fast:
        assert sound, (
            f"the pass cleared a batch the rules do not ({slow!r}, dense: {dense is batch})"
        )
    elif not cautious:
        assert not sound, "the pass refused a plain batch the rules clear"
    if not changes and not subclass and device.type == "cpu" and spec_block_size is None:
        assert fast  # a sound batch

    # the builder's two entry points, with the pass and without it
    for checked in (validation.checked_structure, validation.checked_step):
        assert validation.use_speedups(True)
        with_pass = _verdict(lambda: checked(spec, batch, device))  # noqa: B023
        validation.use_speedups(False)
        _same(with_pass, _verdict(lambda: checked(spec, batch, device)))  # noqa: B023


@structure_pass
def test_a_sound_batch_is_cleared_as_it_is() -> None:
    batch = BatchMetadata.from_lengths(
        [1, 5, 1], [20, 9, 33], [[1, 2, 3], [4, 5, 6], [7, 8, 9]], 16
    )
    assert validation.use_speedups(True) and validation.structure_pass_in_use()
    got, facts = validation.checked_structure(_spec(16), batch, CPU)
    assert got is batch and facts is validation.STRUCTURAL_FACTS
    got, facts = validation.checked_step(_spec(16), batch, CPU)
    assert got is batch and facts.max_slot == int(batch.slot_mapping.max()) == 9 * 16


@structure_pass
def test_under_a_torch_function_mode_the_rules_decide() -> None:
    """A TorchFunctionMode sees Python's reads of tensor attributes (it could answer them its
    way), so the pass leaves the batch to the rules while one is active."""
    from torch.overrides import TorchFunctionMode

    class Passing(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            return func(*args, **(kwargs or {}))

    batch = BatchMetadata.from_lengths([1, 2], [5, 9], [[1], [2]], 16)
    assert validation._compiled_step_structure(batch, 16, CPU)
    with Passing():
        assert not validation._compiled_step_structure(batch, 16, CPU)
        got, facts = validation.checked_structure(_spec(16), batch, CPU)
    assert got is batch and facts is validation.STRUCTURAL_FACTS


@structure_pass
def test_the_pass_is_off_with_the_python_rules() -> None:
    validation.use_speedups(False)
    assert not validation.structure_pass_in_use()
    assert validation.use_speedups(True)
    assert validation.structure_pass_in_use()


@structure_pass
def test_the_pass_is_used_only_with_the_torch_it_was_built_against(monkeypatch: Any) -> None:
    from attnhub_speedups import _step_structure

    assert torch.__version__ == _step_structure.TORCH_BUILT_WITH
    monkeypatch.setattr(_step_structure, "TORCH_BUILT_WITH", "2.0.0")
    found, why = validation._installed_step_structure()
    assert found is None
    assert "built against torch 2.0.0" in why and torch.__version__ in why
    import attnhub_speedups

    monkeypatch.delattr(attnhub_speedups, "_step_structure")  # as where it was not built
    monkeypatch.setitem(sys.modules, "attnhub_speedups._step_structure", None)
    found, why = validation._installed_step_structure()
    assert found is None and "not importable" in why
