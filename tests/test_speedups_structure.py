"""attnhub-speedups' compiled structure pass (``_step_structure``, read through torch's C++ API)
held to the Python rules (``validation.STRUCTURE`` and ``dense_batch``): it clears a batch only
where the rules do and the batch is dense, and clears every plain sound batch (it may refuse
what it does not read as Python would: tensor subclasses, lengths that are not ints). A builder
with the pass and without it returns the same dense batch and facts, or raises the same error.
Also: the pass is used only with the torch it was built against."""

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
from attnhub.spec import AttentionSpec

pytestmark = pytest.mark.skipif(
    validation._compiled_step_structure is None,
    reason="attnhub-speedups' structure pass is not built here: "
    f"{validation.STRUCTURE_PASS_MISSING} (nox builds it, so CI runs these tests)",
)

CPU = torch.device("cpu")
TENSORS = (
    "query_start_loc",
    "query_start_loc_cpu",
    "seq_lens",
    "seq_lens_cpu",
    "block_table",
    "block_table_cpu",
    "slot_mapping",
    "slot_mapping_cpu",
)


class _Traced(torch.Tensor):
    """A tensor subclass (its own ``__torch_function__`` could answer attribute reads its way)."""


class _Batch(BatchMetadata):
    """A subclass of BatchMetadata (it could redefine a field as a property)."""


@pytest.fixture(autouse=True)
def _restored() -> Any:
    was = validation.speedups_in_use()
    yield
    validation.use_speedups(was)


def _spec(block_size: int) -> AttentionSpec:
    return AttentionSpec(
        num_heads=2, num_kv_heads=1, head_size=8, dtype=torch.float32, block_size=block_size
    )


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
        for name in TENSORS
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
    "on meta": lambda t: t.to("meta"),
    "subclass": lambda t: t.as_subclass(_Traced),
    "None": lambda t: None,
    "a list": lambda t: t.tolist(),
}
#: ... or a scalar field.
SCALAR_CHANGES = {
    "num_reqs + 1": ("num_reqs", lambda v: v + 1),
    "num_reqs - 1": ("num_reqs", lambda v: v - 1),
    "num_reqs as numpy": ("num_reqs", lambda v: np.int64(v)),
    "num_reqs as float": ("num_reqs", lambda v: float(v)),
    "num_reqs beyond int64": ("num_reqs", lambda v: v + 2**70),
    "block_size + 1": ("block_size", lambda v: v + 1),
    "block_size as numpy": ("block_size", lambda v: np.int32(v)),
    "num_actual_tokens + 1": ("num_actual_tokens", lambda v: v + 1),
    "num_actual_tokens as numpy": ("num_actual_tokens", lambda v: np.int64(v)),
}
#: Changes the pass may refuse although the rules clear them (it reads them not as Python
#: does): it must then leave the batch to the rules.
CAUTIOUS = {
    "subclass",
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
    for name in TENSORS:
        x, y = getattr(batch_a, name), getattr(batch_b, name)
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), name
    assert type(facts_a) is type(facts_b) or validation.StepFacts in (
        type(facts_a).__mro__[1:] + type(facts_b).__mro__[1:]
    )
    for name in ("max_slot", "max_block", "min_slot", "min_query_len", "min_context_len"):
        assert getattr(facts_a, name) == getattr(facts_b, name), name


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=sound_batches(),
    changes=st.lists(
        st.tuples(st.sampled_from(TENSORS), st.sampled_from(sorted(TENSOR_CHANGES)))
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
            if isinstance(fields[name], torch.Tensor):
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


def test_a_sound_batch_is_cleared_as_it_is() -> None:
    batch = BatchMetadata.from_lengths(
        [1, 5, 1], [20, 9, 33], [[1, 2, 3], [4, 5, 6], [7, 8, 9]], 16
    )
    assert validation.use_speedups(True) and validation.structure_pass_in_use()
    got, facts = validation.checked_structure(_spec(16), batch, CPU)
    assert got is batch and facts is validation.STRUCTURAL_FACTS
    got, facts = validation.checked_step(_spec(16), batch, CPU)
    assert got is batch and facts.max_slot == int(batch.slot_mapping.max()) == 9 * 16


def test_the_pass_is_off_with_the_python_rules() -> None:
    validation.use_speedups(False)
    assert not validation.structure_pass_in_use()
    assert validation.use_speedups(True)
    assert validation.structure_pass_in_use()


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


def test_attnhub_speedups_0_turns_the_structure_pass_off() -> None:
    code = "from attnhub import validation as v; print(v.structure_pass_in_use())"
    for value, expected in (("0", "False"), ("1", "True")):
        env = dict(os.environ, ATTNHUB_SPEEDUPS=value)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.split() == [expected]
