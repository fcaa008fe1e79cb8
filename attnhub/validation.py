"""What a valid attention call is. Every check runs before anything is written, so a rejected
call leaves the KV cache byte-identical. Errors are InvalidInputError naming the bad value.

Per step, ``build`` reads the batch's host copies once (:func:`step_extents`): every slot is -1 or
a slot, every block a request reads is a block, and the largest of each is remembered. Per layer,
``forward`` and ``write_kv(meta=)`` compare those two numbers with the cache's size
(:func:`check_extents`): O(1), no tensor read, so no device-to-host sync ever.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch

from attnhub.batch import BatchMetadata
from attnhub.errors import InvalidInputError
from attnhub.kv_cache import PagedKVCache
from attnhub.spec import KV_CACHE_DTYPES, AttentionSpec


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


same_device = _same_device


def spec_differences(built_for: AttentionSpec, mine: AttentionSpec) -> str:
    """``"block_size 32 (this layer: 16), ..."``: the fields where two specs differ."""
    parts = [
        f"{f.name} {getattr(built_for, f.name)!r} (this layer: {getattr(mine, f.name)!r})"
        for f in fields(built_for)
        if getattr(built_for, f.name) != getattr(mine, f.name)
    ]
    return ", ".join(parts) or "equal fields, unequal specs"


def same_view(a: object, b: torch.Tensor) -> bool:
    """Whether ``a`` is a tensor viewing the same elements as ``b`` (e.g. another slice object
    of the same engine buffer). Reads no values."""
    return a is b or (
        isinstance(a, torch.Tensor)
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def check_tensor(
    name: str,
    t: object,
    shape: tuple[int | None, ...],
    dtype: torch.dtype | tuple[torch.dtype, ...],
    device: torch.device,
) -> torch.Tensor:
    """``t`` is a tensor of ``shape`` (None = any size), ``dtype`` and ``device``."""
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    got = t.shape
    # this runs several times per layer call: one tuple comparison in the usual case (a
    # leading None, the token count, then fixed sizes)
    if len(got) != len(shape):
        wrong_shape = True
    elif shape and shape[0] is None and None not in shape[1:]:
        wrong_shape = got[1:] != shape[1:]
    else:
        wrong_shape = any(s is not None and s != n for s, n in zip(shape, got, strict=True))
    if wrong_shape:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise InvalidInputError(f"{name} has shape {list(got)}, expected {want}")
    if t.dtype is not dtype and (not isinstance(dtype, tuple) or t.dtype not in dtype):
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
        raise InvalidInputError(
            f"{name} has dtype {t.dtype}, expected {' or '.join(str(d) for d in dtypes)}"
        )
    if t.device != device and not _same_device(t.device, device):
        raise InvalidInputError(f"{name} is on {t.device}, expected {device}")
    return t


def check_cache(
    spec: AttentionSpec,
    layout: str,
    cache: PagedKVCache,
    device: torch.device,
    *,
    strided: bool = True,
) -> None:
    """The cache has this spec's geometry, storage dtypes, layout and scale planes; with
    ``strided=False`` (a backend whose kernels need it) each K/V plane is contiguous."""
    if not isinstance(cache, PagedKVCache):
        raise InvalidInputError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    if cache.layout != layout:
        raise InvalidInputError(f"cache layout is {cache.layout!r}, this backend uses {layout!r}")
    if cache.kv_cache_dtype != spec.kv_cache_dtype:
        raise InvalidInputError(
            f"cache kv_cache_dtype is {cache.kv_cache_dtype!r}, the spec says "
            f"{spec.kv_cache_dtype!r}"
        )
    if cache.block_size != spec.block_size:
        raise InvalidInputError(
            f"cache block_size is {cache.block_size}, the spec says {spec.block_size}"
        )
    if (cache.num_kv_heads, cache.head_size) != (spec.num_kv_heads, spec.head_size):
        raise InvalidInputError(
            f"cache holds {cache.num_kv_heads} kv heads of size {cache.head_size}, the spec "
            f"says {spec.num_kv_heads} of size {spec.head_size}"
        )
    kdt, vdt = KV_CACHE_DTYPES[spec.kv_cache_dtype].storage_dtypes(spec.dtype)
    if cache.key.dtype != kdt or cache.value.dtype != vdt:
        raise InvalidInputError(
            f"cache stores {cache.key.dtype}/{cache.value.dtype}, kv_cache_dtype "
            f"{spec.kv_cache_dtype!r} needs {kdt}/{vdt}"
        )
    if not _same_device(cache.device, device):
        raise InvalidInputError(f"cache is on {cache.device}, expected {device}")
    if not strided and not (cache.key.is_contiguous() and cache.value.is_contiguous()):
        raise InvalidInputError(
            "this backend's kernels need contiguous key and value planes (capabilities."
            f"strided_kv_cache is False); got strides {cache.key.stride()} / "
            f"{cache.value.stride()} (allocate with backend.allocate_kv_cache, or lay K and V out "
            "as two planes)"
        )
    fmt = KV_CACHE_DTYPES[spec.kv_cache_dtype]
    for which in ("key_scale", "value_scale"):
        if getattr(fmt, which) != "none" and getattr(cache, which) is None:
            raise InvalidInputError(
                f"kv_cache_dtype {spec.kv_cache_dtype!r} needs cache.{which}, which is None"
            )


def check_kv(
    spec: AttentionSpec, key: object, value: object, device: torch.device, num_slots: int
) -> None:
    """New keys/values: [n >= num_slots, num_kv_heads, head_size] in the model dtype."""
    shape = (None, spec.num_kv_heads, spec.head_size)
    k = check_tensor("key", key, shape, spec.dtype, device)
    v = check_tensor("value", value, shape, spec.dtype, device)
    if k.shape[0] != v.shape[0]:
        raise InvalidInputError(f"key has {k.shape[0]} tokens but value has {v.shape[0]}")
    if k.shape[0] < num_slots:
        raise InvalidInputError(
            f"key has {k.shape[0]} tokens but slot_mapping has {num_slots} entries"
        )


def check_slot_values(slot_mapping: torch.Tensor, cache: PagedKVCache) -> None:
    """Every slot is -1 (padding) or inside the cache: for ``write_kv`` given a slot mapping of
    its own (not a step's). Reads values on the host (numpy: a torch reduction costs several
    times more on tensors this small); a slot mapping on an accelerator is copied to the host
    first, which is why engines write with ``write_kv(meta=)`` (checked once per step)."""
    if not slot_mapping.numel():
        return
    host = slot_mapping.to("cpu").numpy()
    if host.min() >= -1 and host.max() < cache.num_slots:
        _check_distinct_slots(host if host.min() >= 0 else host[host >= 0], host)
        return
    i = int(np.flatnonzero((host < -1) | (host >= cache.num_slots))[0])
    raise InvalidInputError(_slot_outside(i, int(host[i]), cache))


def _slot_outside(i: int, slot: int, cache: PagedKVCache) -> str:
    return (
        f"slot_mapping[{i}] = {slot} is outside the cache "
        f"({cache.num_blocks} blocks x {cache.block_size} slots)"
        + ("; use -1 for padding" if slot < 0 else "")
    )


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~1.3 us more per step
class StepExtents:
    """Upper bounds of the cache addresses a step uses, found once per step on its host copies.
    ``check_extents`` compares them with a cache; only when one does not fit does it look at
    the step's host data again, to name the entry or to clear a block-table entry no request
    reads.

    :func:`check_step` also keeps what it read on the way, for the builder's ``plan`` to reuse
    instead of reading the batch again (``AttentionMetadataBuilder.step``)."""

    max_slot: int  # the largest slot written (-1: none)
    max_block: int  # the largest block-table entry, read or not (-1: no request)
    min_slot: int = -1  # the smallest slot_mapping entry (-1: padding, or no token)
    #: Host facts of the step (None where step_extents made this alone).
    query_lens: np.ndarray | None = field(default=None, repr=False, compare=False)  # [B]
    seq_lens: np.ndarray | None = field(default=None, repr=False, compare=False)  # [B]
    context_lens: np.ndarray | None = field(default=None, repr=False, compare=False)  # [B]
    min_query_len: int = 0
    min_context_len: int = 0
    #: The host copies as numpy, read once (``.numpy()`` costs ~1 us a call): [B + 1] query
    #: start offsets and [B, max_blocks] block table (None where step_extents made this alone).
    query_start_locs: np.ndarray | None = field(default=None, repr=False, compare=False)
    block_table: np.ndarray | None = field(default=None, repr=False, compare=False)
    #: The backend whose builder made the step (set by ``build``; layers accept the step only
    #: for a backend of its kind, spec and device: AttentionImpl._check_owner).
    owner: object = field(default=None, repr=False, compare=False)
    #: The slot mapping the engine gave, where ``build`` made a dense copy of a strided one
    #: (``write_kv(slot_mapping=, meta=)`` accepts either).
    given_slot_mapping: torch.Tensor | None = field(default=None, repr=False, compare=False)


def step_extents(batch: BatchMetadata) -> StepExtents:
    """Check the step's slot and block values that need no cache (slots >= -1 and distinct,
    blocks read >= 0) and bound the largest of each, on the batch's host copies. A handful of
    numpy reductions: no per-request work on the usual step."""
    # ufunc.reduce directly: ndarray.max() adds a Python wrapper (~1 us each) on tiny arrays
    slots = batch.host_slot_mapping().numpy()
    max_slot = -1
    if slots.size:
        max_slot, lowest = int(_MAX(slots)), int(_MIN(slots))
        if lowest < -1:
            i = int(np.flatnonzero(slots < -1)[0])
            raise InvalidInputError(
                f"slot_mapping[{i}] = {int(slots[i])} is not a slot; use -1 for padding"
            )
        if slots.size > 1:
            _check_distinct_slots(slots if lowest >= 0 else slots[slots >= 0], slots)
    max_block = -1
    if batch.num_reqs:
        table = batch.host_block_table().numpy()  # [B, max_blocks]
        max_block = int(_MAX(table, axis=None))
        if int(_MIN(table, axis=None)) < 0:  # entries past a request's blocks may be anything
            bad = np.argwhere(_in_use(batch, table.shape[1]) & (table < 0))
            if bad.size:
                r, c = int(bad[0, 0]), int(bad[0, 1])
                raise InvalidInputError(f"block_table[{r}, {c}] = {int(table[r, c])} is negative")
    return StepExtents(max_slot, max_block)


_MAX, _MIN = np.maximum.reduce, np.minimum.reduce


def _in_use(batch: BatchMetadata, width: int) -> np.ndarray:  # [B, width] bool
    """Which block-table entries the requests read (their first ceil(seq_len / block_size))."""
    bs = batch.block_size
    used = (batch.seq_lens_cpu.numpy().astype(np.int64) + bs - 1) // bs
    return np.arange(width)[None, :] < used[:, None]


def _check_distinct_slots(written: np.ndarray, slots: np.ndarray) -> None:
    """No two tokens of a step write the same slot (an engine bug: two requests' blocks
    overlap, or a stale block table); one sort of the written slots, on the host."""
    ordered = np.sort(written)
    same = ordered[1:] == ordered[:-1]
    if not np.logical_or.reduce(same):
        return
    slot = int(ordered[1:][same][0])
    i, j = (int(x) for x in np.flatnonzero(slots == slot)[:2])
    raise InvalidInputError(
        f"slot_mapping[{i}] and slot_mapping[{j}] are both {slot}: two tokens of one step "
        "would write the same cache slot (do two requests' blocks overlap?)"
    )


def check_extents(extents: StepExtents, batch: BatchMetadata, cache: PagedKVCache) -> None:
    """The step's slots and blocks fit ``cache``: two integer comparisons. Only when a bound
    does not fit are the step's host copies read again (never device memory), to name the
    entry, or to find that the large block-table entry is one no request reads."""
    if extents.max_slot >= cache.num_slots:
        slots = batch.host_slot_mapping().numpy()
        i = int(np.flatnonzero(slots >= cache.num_slots)[0])
        raise InvalidInputError(_slot_outside(i, int(slots[i]), cache))
    if extents.max_block >= cache.num_blocks:
        table = batch.host_block_table().numpy()
        bad = np.argwhere(_in_use(batch, table.shape[1]) & (table >= cache.num_blocks))
        if bad.size:
            r, c = int(bad[0, 0]), int(bad[0, 1])
            raise InvalidInputError(
                f"block_table[{r}, {c}] = {int(table[r, c])} is outside the cache "
                f"({cache.num_blocks} blocks)"
            )


def check_batch_for_spec(spec: AttentionSpec, batch: BatchMetadata, device: torch.device) -> None:
    if not isinstance(batch, BatchMetadata):
        raise InvalidInputError(f"batch must be a BatchMetadata, got {type(batch).__name__}")
    if batch.block_size != spec.block_size:
        raise InvalidInputError(
            f"batch block_size is {batch.block_size}, the spec says {spec.block_size}"
        )
    if not _same_device(batch.device, device):
        raise InvalidInputError(f"batch tensors are on {batch.device}, expected {device}")
    batch.validate()


_OR = np.logical_or.reduce
#: A signed table read as unsigned: its dtype, and the largest value without a negative entry.
_UNSIGNED = {
    np.dtype(np.int32): (np.uint32, np.iinfo(np.int32).max),
    np.dtype(np.int64): (np.uint64, np.iinfo(np.int64).max),
}


def check_step(spec: AttentionSpec, batch: BatchMetadata, device: torch.device) -> StepExtents:
    """Everything :func:`check_batch_for_spec` and :func:`step_extents` check, once per step,
    in as few host operations as the usual step allows (a step is paid on every engine step:
    a numpy reduction costs ~1 us, a torch op 3-5 us). Every condition is the same as theirs;
    where one fails, they run to name what is wrong, with their errors."""
    if not isinstance(batch, BatchMetadata) or batch.block_size != spec.block_size:
        check_batch_for_spec(spec, batch, device)
        raise AssertionError("unreachable: check_batch_for_spec accepted the batch")
    dev = batch.query_start_loc.device
    if (dev != device and not _same_device(dev, device)) or not _structure_ok(batch, dev):
        check_batch_for_spec(spec, batch, device)
        raise AssertionError("unreachable: check_batch_for_spec accepted the batch")
    B = batch.num_reqs
    if not B:
        if batch.num_actual_tokens:
            batch.validate()
        return step_extents(batch)
    # lengths: BatchMetadata.validate's value checks
    qsl = batch.query_start_loc_cpu.numpy()
    seq = batch.seq_lens_cpu.numpy()
    qlens = qsl[1:] - qsl[:-1]
    total = int(qsl[-1])
    hi_q = int(_MAX(qlens))
    ctx = seq - qlens
    if total - int(qsl[0]) == B * hi_q:
        # the query lens sum to B times the longest: all equal (the usual decode step), so
        # the shortest is the longest and the shortest context is the shortest sequence's
        lo_q, lo_s = hi_q, int(_MIN(seq))
        lo_c = lo_s - hi_q
    else:
        lo_q, lo_c = int(_MIN(qlens)), int(_MIN(ctx))
    hi_s = int(_MAX(seq))
    slot_mapping = batch.slot_mapping
    if not (
        int(qsl[0]) == 0
        and lo_q >= 1
        and lo_c >= 0
        and -(-hi_s // batch.block_size) <= batch.block_table.shape[1]
        and hi_q == batch.max_query_len
        and hi_s == batch.max_seq_len
        and total == batch.num_actual_tokens
        and slot_mapping.dim() == 1
        and slot_mapping.shape[0] >= total
    ):
        batch.validate()
        raise AssertionError("unreachable: BatchMetadata.validate accepted the batch")
    # slots: >= -1 and distinct where written; one sort gives both ends
    slots = batch.host_slot_mapping().numpy()
    max_slot = min_slot = -1
    if slots.size == 1:
        max_slot = min_slot = int(slots[0])
    elif slots.size:
        ordered = slots.copy()
        ordered.sort()
        min_slot, max_slot = int(ordered[0]), int(ordered[-1])
        if min_slot < 0:
            ordered = ordered[int(np.searchsorted(ordered, 0)) :]
        # sorted: distinct where no two neighbours are equal (a difference is never below 0)
        if ordered.size > 1 and int(_MIN(ordered[1:] - ordered[:-1])) == 0:
            step_extents(batch)  # names the two tokens
            raise AssertionError("unreachable: step_extents accepted duplicate slots")
    if min_slot < -1:
        step_extents(batch)  # names the slot
        raise AssertionError("unreachable: step_extents accepted a slot below -1")
    # blocks: read as unsigned, one reduction bounds them and finds any negative entry
    table = batch.host_block_table().numpy()  # [B, max_blocks]
    unsigned, largest = _UNSIGNED.get(table.dtype, (None, -1))
    # (a 1-D reduction: axis=None costs ~2 us more on tables this small)
    top = int(_MAX(table.reshape(-1).view(unsigned))) if unsigned is not None else -1
    if top > largest or unsigned is None:  # a negative entry (or another dtype)
        extents = step_extents(batch)  # raises where a request reads it
        top = extents.max_block
    return StepExtents(
        max_slot=max_slot,
        max_block=top,
        min_slot=min_slot,
        query_lens=qlens,
        seq_lens=seq,
        context_lens=ctx,
        min_query_len=lo_q,
        min_context_len=lo_c,
        query_start_locs=qsl,
        block_table=table,
    )


def _structure_ok(batch: BatchMetadata, dev: torch.device) -> bool:
    """BatchMetadata.validate's shape, dtype and device conditions, all at once."""
    # (``is_cpu`` and whole-shape comparisons: ``t.device.type`` costs ~0.45 us, ``is_cpu``
    # 0.06; this runs on every step)
    ints = _INT_DTYPES
    B = batch.num_reqs
    qsl, seq = batch.query_start_loc_cpu, batch.seq_lens_cpu
    table, slots = batch.block_table, batch.slot_mapping
    if not (
        qsl.shape == (B + 1,)
        and seq.shape == (B,)
        and batch.query_start_loc.dtype in ints
        and batch.seq_lens.dtype in ints
        and table.dtype in ints
        and slots.dtype in ints
        and qsl.dtype in ints
        and seq.dtype in ints
        and qsl.is_cpu
        and seq.is_cpu
        and batch.seq_lens.device == dev
        and table.device == dev
        and slots.device == dev
        and table.ndim == 2
        and table.shape[0] == B
    ):
        return False
    for copy, t in ((batch.block_table_cpu, table), (batch.slot_mapping_cpu, slots)):
        if copy is not None and not (copy.shape == t.shape and copy.is_cpu and copy.dtype in ints):
            return False
    return True


_INT_DTYPES = (torch.int32, torch.int64)


#: A batch's integer tensors that kernels may read, by field name (host copies included:
#: some kernels take lengths from the host).
_DENSE_FIELDS = (
    "query_start_loc",
    "query_start_loc_cpu",
    "seq_lens",
    "seq_lens_cpu",
    "block_table",
    "block_table_cpu",
    "slot_mapping",
    "slot_mapping_cpu",
)


def dense_batch(batch: BatchMetadata) -> BatchMetadata:
    """``batch`` itself when every integer tensor of it is dense (the usual step: eight
    ``is_contiguous`` calls, no op dispatched); else a copy of it whose strided ones are made
    contiguous (a device copy, no sync). A kernel reads slots, tables and lengths through a raw
    pointer: a strided view, e.g. every other entry of an engine's buffer, would have it read
    the wrong entries (a write to the wrong slots). Anything that is not a batch of tensors is
    returned as it is, for :func:`check_step` to name."""
    try:
        if (
            batch.slot_mapping.is_contiguous()
            and batch.block_table.is_contiguous()
            and batch.query_start_loc.is_contiguous()
            and batch.seq_lens.is_contiguous()
            and batch.query_start_loc_cpu.is_contiguous()
            and batch.seq_lens_cpu.is_contiguous()
            and (batch.block_table_cpu is None or batch.block_table_cpu.is_contiguous())
            and (batch.slot_mapping_cpu is None or batch.slot_mapping_cpu.is_contiguous())
        ):
            return batch
    except AttributeError:  # not a BatchMetadata, or a field that is not a tensor
        return batch
    dense: dict[str, Any] = {}
    for name in _DENSE_FIELDS:
        t = getattr(batch, name)
        if isinstance(t, torch.Tensor) and not t.is_contiguous():
            dense[name] = t.contiguous()
    return replace(batch, **dense)


def check_dense(batch: BatchMetadata, why: str) -> None:
    """Every integer tensor of ``batch`` is dense, else InvalidInputError naming it and its
    strides (where a dense copy is not an option: ``why``)."""
    for name in _DENSE_FIELDS:
        t = getattr(batch, name)
        if isinstance(t, torch.Tensor) and not t.is_contiguous():
            raise InvalidInputError(
                f"batch.{name} is a strided view (shape {tuple(t.shape)}, strides "
                f"{t.stride()}): {why}, so it must be contiguous"
            )


def check_common_prefix(batch: BatchMetadata, common_prefix_len: object, step: StepExtents) -> None:
    """``common_prefix_len`` is an int in 0..the shortest context, and its whole blocks are
    the same blocks in every request's table: a cascade reads the shared prefix from the first
    request's table for every request, so a table that differs there would have the others
    attend over another request's keys. Host data only (the table as the step's checks read
    it)."""
    if isinstance(common_prefix_len, bool) or not isinstance(common_prefix_len, int):
        raise InvalidInputError(f"common_prefix_len = {common_prefix_len!r} must be an int")
    if common_prefix_len < 0 or (
        batch.num_reqs and common_prefix_len > int(batch.context_lens_cpu.min())
    ):
        raise InvalidInputError(
            f"common_prefix_len = {common_prefix_len} must be in 0..the shortest context"
        )
    blocks = common_prefix_len // batch.block_size
    if not blocks or batch.num_reqs < 2:
        return
    table = step.block_table if step.block_table is not None else batch.host_block_table().numpy()
    shared = table[:, :blocks]
    differs = (shared != shared[:1]).any(axis=1)
    if bool(differs.any()):
        r = int(np.flatnonzero(differs)[0])
        raise InvalidInputError(
            f"common_prefix_len = {common_prefix_len} covers block_table[:, :{blocks}], but "
            f"block_table[{r}, :{blocks}] = {table[r, :blocks].tolist()} differs from "
            f"block_table[0, :{blocks}] = {table[0, :blocks].tolist()}: the requests do not "
            "share that prefix"
        )
