"""What the base classes enforce for every backend, whatever it computes."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import pytest
import torch

from attnhub import AttentionSpec, BatchMetadata, get_backend
from attnhub.backend import AttentionMetadata, _metadata_maker, scratch_field
from attnhub.errors import UnsupportedConfigurationError
from attnhub.torch_backend import TorchAttentionImpl, TorchBackend, TorchMetadataBuilder
from attnhub.torch_backend.backend import TorchAttentionMetadata
from attnhub.torch_backend.mla import TorchMLAMetadata

METADATA_TYPES = [TorchAttentionMetadata, TorchMLAMetadata]


def _restricted(**capability_changes: object) -> type[TorchBackend]:
    caps = dataclasses.replace(TorchBackend.capabilities, **capability_changes)
    return type("Restricted", (TorchBackend,), {"name": "restricted", "capabilities": caps})


SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, dtype=torch.float32, block_size=4)


def _batch(query_lens: list[int], seq_lens: list[int]) -> BatchMetadata:
    tables, next_block = [], 1
    for s in seq_lens:
        n = -(-s // 4)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    return BatchMetadata.from_lengths(query_lens, seq_lens, tables, 4)


def test_torch_backend_reports_a_device_torch_cannot_use():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    why = get_backend("torch").availability("cuda")
    assert why is not None and "cuda" in why


def test_undeclared_chunked_prefill_is_refused_with_the_request_named():
    backend = _restricted(chunked_prefill=False)(SPEC)
    builder = backend.metadata_builder()
    assert builder.reorder_batch_threshold == 16  # longer queries over context are prefills
    with pytest.raises(UnsupportedConfigurationError, match=r"request 1 .*chunked prefill"):
        builder.build(_batch([1, 20], [9, 24]))


def test_prefill_without_context_needs_no_chunked_prefill_support():
    backend = _restricted(chunked_prefill=False)(SPEC)
    backend.metadata_builder().build(_batch([1, 6], [9, 6]))


def test_undeclared_multi_token_decode_is_refused_below_the_reorder_threshold():
    backend = _restricted(multi_token_decode=False)(SPEC)
    builder = backend.metadata_builder()
    builder.reorder_batch_threshold = 4  # type: ignore[misc]
    with pytest.raises(UnsupportedConfigurationError, match=r"request 0 .*multi-token decode"):
        builder.build(_batch([3, 1], [9, 10]))
    builder.build(_batch([6, 1], [9, 10]))  # above the threshold: a chunked prefill


# --- the narrow protocol: build -> plan(step); forward -> checks -> compute ---------------------
class _RecordingBuilder(TorchMetadataBuilder):
    steps: ClassVar[list[Any]] = []

    def plan(self, step):  # type: ignore[no-untyped-def]
        self.steps.append(step)
        return super().plan(step)


class _RecordingImpl(TorchAttentionImpl):
    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, object]] = []

    def compute(self, query, key, value, cache, meta, out):  # type: ignore[no-untyped-def]
        self.calls.append(("compute", meta))
        super().compute(query, key, value, cache, meta, out)

    def store_kv(self, key, value, cache, slot_mapping, meta=None):  # type: ignore[no-untyped-def]
        self.calls.append(("store_kv", meta))
        super().store_kv(key, value, cache, slot_mapping, meta)


class _Recording(TorchBackend):
    """The torch backend, recording what the core hands its hooks."""

    name = "recording"
    builder_type = _RecordingBuilder
    impl_type = _RecordingImpl


def test_build_hands_plan_the_checked_step_and_makes_the_metadata_of_what_it_returns():
    backend = _Recording(SPEC)
    builder = backend.metadata_builder()
    assert type(builder) is _RecordingBuilder and type(backend.impl()) is _RecordingImpl
    batch = _batch([1, 3], [9, 3])
    _RecordingBuilder.steps.clear()
    meta = builder.build(batch)
    (step,) = _RecordingBuilder.steps
    assert step.batch is batch and meta.batch is batch and step.backend is backend
    assert step.extents is meta.extents and meta.extents.owner is backend
    assert step.facts.query_lens is not None and step.facts.query_lens.tolist() == [1, 3]
    assert meta.plan is not None and meta.gather_buffers is not None  # what plan returned
    with pytest.raises(AttributeError):  # immutable
        step.batch = batch  # type: ignore[misc]


def test_forward_runs_compute_after_the_checks_and_store_kv_gets_the_step():
    from attnhub.errors import InvalidInputError
    from attnhub.testing import generator, random_qkv

    backend = _Recording(SPEC)
    batch = _batch([1, 3], [9, 3])
    meta = backend.metadata_builder().build(batch)
    impl = backend.impl()
    cache = backend.allocate_kv_cache(8)
    q, k, v = random_qkv(SPEC, batch.num_tokens, generator(0))
    impl.forward(q, k, v, cache, meta)
    assert impl.calls == [("compute", meta), ("store_kv", meta)]
    impl.calls.clear()
    with pytest.raises(InvalidInputError):  # refused before any kernel work
        impl.forward(q[:, :1], k, v, cache, meta)
    assert impl.calls == []
    impl.write_kv(k, v, cache, meta=meta)
    impl.write_kv(k, v, cache, batch.slot_mapping)
    assert impl.calls == [("store_kv", meta), ("store_kv", None)]


# --- the metadata the base class makes: its constructor's result, made faster ----------------
@dataclasses.dataclass(frozen=True)
class _Planned(AttentionMetadata):
    required: int = dataclasses.field(default=0)
    table: list[int] = dataclasses.field(default_factory=list)
    scratch: list[int] = scratch_field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class _Checked(AttentionMetadata):  # made by its constructor: it checks itself
    width: int = 1

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"width {self.width}")


@pytest.mark.parametrize("cls", [AttentionMetadata, _Planned, _Checked, *METADATA_TYPES])
def test_made_metadata_equals_its_constructors(cls: type[AttentionMetadata]) -> None:
    batch = _batch([1, 3], [9, 3])
    values = {"batch": batch, "common_prefix_len": 0, "extents": None}
    made, built = _metadata_maker(cls)(dict(values)), cls(**values)
    assert type(made) is cls and made == built
    for f in dataclasses.fields(cls):  # defaults and factories too (not shared between steps)
        assert getattr(made, f.name) == getattr(built, f.name), f.name
        if f.default_factory is not dataclasses.MISSING:
            assert getattr(made, f.name) is not getattr(_metadata_maker(cls)(dict(values)), f.name)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.common_prefix_len = 1  # type: ignore[misc]
    with pytest.raises(TypeError, match="bogus"):  # the constructor's own error
        _metadata_maker(cls)({**values, "bogus": 1})
    with pytest.raises(TypeError, match="batch"):
        _metadata_maker(cls)({"common_prefix_len": 0})


def test_metadata_with_a_post_init_is_made_by_its_constructor() -> None:
    batch = _batch([1], [1])
    with pytest.raises(ValueError, match="width 0"):
        _metadata_maker(_Checked)({"batch": batch, "width": 0})


@dataclasses.dataclass(frozen=True)
class _NeedsWidth(AttentionMetadata):  # a planned field without a default: plan must give it
    width: int = dataclasses.field(kw_only=True)


@pytest.mark.parametrize("cls", [AttentionMetadata, _Planned, _NeedsWidth, *METADATA_TYPES])
def test_metadata_of_a_step_equals_its_constructors(cls: type[AttentionMetadata]) -> None:
    # of_step (build's path) sets the base fields from the step itself: the same metadata as
    # the constructor, the same errors for an unknown or a missing planned field
    batch = _batch([1, 3], [9, 3])
    step = TorchBackend(SPEC).metadata_builder().check_step(batch)
    planned = {"width": 2} if cls is _NeedsWidth else {}
    made = _metadata_maker(cls).of_step(step, planned)
    built = cls(batch=step.batch, common_prefix_len=0, extents=step.extents, **planned)
    assert type(made) is cls and made == built and made.extents is step.extents
    with pytest.raises(TypeError, match="bogus"):
        _metadata_maker(cls).of_step(step, {**planned, "bogus": 1})
    if cls is _NeedsWidth:
        with pytest.raises(TypeError, match="width"):
            _metadata_maker(cls).of_step(step, {})
        with pytest.raises(TypeError):  # a missing field and an unknown one: counts that match
            _metadata_maker(cls).of_step(step, {"bogus": 1})


def test_structural_steps_share_read_only_facts_and_extents() -> None:
    # Checked for their structure only, every step's facts and extents are the same (nothing
    # read, nothing bounded): one instance each, and no planner may change them
    builder = TorchBackend(SPEC).metadata_builder()
    builder.checks = "structural"
    first, second = builder.check_step(_batch([1], [9])), builder.check_step(_batch([2], [5]))
    assert first.facts is second.facts and first.extents is second.extents
    assert (first.extents.max_slot, first.extents.max_block) == (-1, -1)
    assert first.extents.owner is builder.backend
    with pytest.raises(AttributeError, match="read only"):
        first.facts.max_slot = 3
    builder.checks = "full"
    full = builder.check_step(_batch([1], [9]))
    assert full.facts is not first.facts and full.extents.max_slot >= 0
