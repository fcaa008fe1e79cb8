"""The validator's rules are written once and read two ways (attnhub.validation.Rules): one
compiled pass for the usual call, the same conditions one by one to name the first that fails.
And a builder's structural checks (``builder.checks = "structural"``): the step's shapes,
dtypes and devices only, for an engine that builds each step itself."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from attnhub import AttentionSpec, BatchMetadata
from attnhub.errors import InvalidInputError
from attnhub.testing import make_batch
from attnhub.torch_backend import TorchBackend
from attnhub.validation import BATCH, LENGTHS, STEP, Rule, Rules, check_step

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.float32, block_size=16)

TOY = Rules(
    "xs, lo",
    [
        Rule("lo >= 0", "xs[{at}] = {int(xs[at])} is negative", at="_first(xs < 0)"),
        Rule("len(xs) < 4", "xs has {len(xs)} entries, at most 3 allowed"),
    ],
)


@pytest.mark.parametrize(
    ("xs", "error"),
    [
        ([1, 2], None),
        ([1, -5, -2], "xs[1] = -5 is negative"),
        ([1, 2, 3, 4], "xs has 4 entries, at most 3 allowed"),
        ([-1, 2, 3, 4], "xs[0] = -1 is negative"),  # the first rule that fails, in order
    ],
)
def test_a_table_passes_exactly_where_its_explanation_finds_nothing(
    xs: list[int], error: str | None
) -> None:
    arr = np.array(xs)
    lo = int(arr.min())
    assert TOY.passes(arr, lo) == (error is None)
    if error is None:
        TOY.explain(arr, lo)  # nothing to name
        return
    with pytest.raises(InvalidInputError, match=error.replace("[", r"\[").replace("]", r"\]")):
        TOY.explain(arr, lo)


def test_a_rule_with_otherwise_defers_to_a_check_that_may_accept() -> None:
    seen: list[int] = []
    table = Rules("x, record", [Rule("x == 0", otherwise="record(x)")])
    assert not table.passes(3, seen.append)
    table.explain(3, seen.append)  # the check accepted: nothing raised
    assert seen == [3]


def _edited(batch: BatchMetadata, **changes: object) -> BatchMetadata:
    return dataclasses.replace(batch, **changes)  # type: ignore[arg-type]


def _good() -> BatchMetadata:
    batch, _ = make_batch([1, 5, 1], [20, 9, 33], 16, num_blocks=12, num_tokens=9)
    return batch


def test_every_step_rule_table_reads_a_good_step_both_ways() -> None:
    batch = _good()
    assert BATCH.passes(batch, SPEC, torch.device("cpu"))
    BATCH.explain(batch, SPEC, torch.device("cpu"))
    extents = check_step(SPEC, batch, torch.device("cpu"))
    assert extents.max_slot == int(batch.slot_mapping.max())
    assert all(item in STEP.items for item in LENGTHS)  # one list of rules, in both tables


def _value_faults(batch: BatchMetadata) -> dict[str, BatchMetadata]:
    slots = batch.slot_mapping.clone()
    slots[1] = slots[0]
    table = batch.block_table.clone()
    table[0, 0] = -3
    below = batch.slot_mapping.clone()
    below[2] = -7
    return {
        "duplicate slots": _edited(batch, slot_mapping=slots),
        "negative block": _edited(batch, block_table=table),
        "slot below -1": _edited(batch, slot_mapping=below),
        "max_seq_len": _edited(batch, max_seq_len=batch.max_seq_len + 1),
    }


@pytest.mark.parametrize(
    "fault", ["duplicate slots", "negative block", "slot below -1", "max_seq_len"]
)
def test_structural_checks_leave_values_to_the_engine(fault: str) -> None:
    backend = TorchBackend(SPEC)
    bad = _value_faults(_good())[fault]
    with pytest.raises(InvalidInputError):
        backend.metadata_builder().build(bad)  # full checks: the default
    builder = backend.metadata_builder()
    builder.checks = "structural"
    meta = builder.build(bad)  # O(1) checks: the value is the engine's responsibility
    assert meta.extents is not None and meta.extents.max_slot == -1


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"slot_mapping": "int"}, "slot_mapping must be int32 or int64, got torch.float32"),
        ({"block_table": "1d"}, "block_table must be [num_reqs=3, max_blocks]"),
        ({"block_size": 32}, "batch block_size is 32, the spec says 16"),
    ],
)
def test_structural_checks_still_refuse_a_wrong_structure_alike(
    change: dict[str, object], named: str
) -> None:
    good = _good()
    if "slot_mapping" in change:
        bad = _edited(good, slot_mapping=good.slot_mapping.float())
    elif "block_table" in change:
        bad = _edited(good, block_table=good.block_table.reshape(-1))
    else:
        bad = _edited(good, **change)
    backend = TorchBackend(SPEC)
    builder = backend.metadata_builder()
    builder.checks = "structural"
    for b in (backend.metadata_builder(), builder):
        with pytest.raises(InvalidInputError) as info:
            b.build(bad)
        assert named in str(info.value)


def test_a_builder_takes_full_or_structural_checks_only() -> None:
    builder = TorchBackend(SPEC).metadata_builder()
    assert builder.checks == "full"
    with pytest.raises(InvalidInputError, match="checks = 'none' must be 'full' or 'structural'"):
        builder.checks = "none"
