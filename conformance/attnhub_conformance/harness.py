"""The harness: build a step (batch, cache, inputs) for a backend, run it, compare with
``attnhub.reference``.

How a step is prepared, so that a backend has every chance to be caught:
  - the block table is a random permutation of the cache's blocks; block 0 stays unused (it pads
    the table) and a few blocks are spare;
  - every cache slot starts as random garbage (finite), so a backend that reads past a sequence's
    end, or writes a slot it should not, changes the answer;
  - the cached context is written by the backend's own ``write_kv`` (as earlier steps would
    have), the new tokens by ``forward``;
  - the reference reads the cache *after* forward, i.e. exactly what the backend stored
    (its quantization included).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from attnhub import AttentionSpec, BatchMetadata, PagedKVCache, reference
from attnhub.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
)
from attnhub.spec import KV_CACHE_DTYPES
from attnhub_conformance.cases import BatchPlan, Case, Config
from attnhub_conformance.targets import Target

SPARE_BLOCKS = 3  # blocks no request uses (the last among them): they stay untouched
FP8_SCALES = (0.025, 0.02)  # per-tensor key / value scales of fp8 caches (engine-set)


def seed_of(text: str) -> int:
    """A stable seed from a case id (the same case gets the same data on every run)."""
    return zlib.crc32(text.encode())


# --- preparing a step --------------------------------------------------------------------------


@dataclass
class Layer:
    """One attention layer's state: its impl (per-layer weights), cache and this step's input."""

    impl: AttentionImpl
    cache: PagedKVCache
    query: torch.Tensor  # [num_tokens, num_heads, head_size]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor
    alibi_slopes: torch.Tensor | None
    sinks: torch.Tensor | None


@dataclass
class Step:
    """One engine step on one backend: the batch and the layers that share its metadata."""

    target: Target
    config: Config
    spec: AttentionSpec
    backend: AttentionBackend
    builder: AttentionMetadataBuilder[Any]  # one per model, as engines hold it
    plan: BatchPlan  # in the order the batch uses (decodes first where the builder asks)
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, host
    num_blocks: int
    batch: BatchMetadata
    label: str  # the case id, for messages
    layers: list[Layer] = field(default_factory=list)
    generator: torch.Generator = field(default_factory=torch.Generator)

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def n(self) -> int:
        return self.batch.num_actual_tokens

    @property
    def common_prefix_len(self) -> int:
        return self.plan.shared_prefix_blocks * self.spec.block_size

    def build(self, batch: BatchMetadata | None = None) -> AttentionMetadata:
        return self.builder.build(
            self.batch if batch is None else batch, common_prefix_len=self.common_prefix_len
        )

    def forward(
        self,
        layer: Layer,
        meta: AttentionMetadata | None = None,
        cache: PagedKVCache | None = None,
        *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``impl.forward`` of ``layer`` (new keys unless the plan has none)."""
        meta = self.build() if meta is None else meta
        key, value = (layer.key, layer.value) if self.plan.new_kv else (None, None)
        cache = layer.cache if cache is None else cache
        if output is None:
            return layer.impl.forward(layer.query, key, value, cache, meta)
        return layer.impl.forward(layer.query, key, value, cache, meta, output=output)

    def add_layer(self) -> Layer:
        layer = _make_layer(self)
        self.layers.append(layer)
        return layer


def prepare(case: Case) -> Step:
    """A step for ``case`` with one layer, the cached context already written."""
    assert case.config is not None
    return prepare_step(case.target, case.config, case.plan(), case.id)


def prepare_step(target: Target, config: Config, plan: BatchPlan, label: str) -> Step:
    spec = config.spec()
    backend = target.create(spec)
    builder = backend.metadata_builder()
    plan = engine_order(plan, builder.reorder_batch_threshold)
    gen = torch.Generator().manual_seed(seed_of(label))
    table, num_blocks = random_block_table(plan, spec.block_size, gen)
    batch = BatchMetadata.from_lengths(
        plan.query_lens,
        plan.seq_lens,
        table,
        spec.block_size,
        backend.device,
        causal=spec.causal,
        num_tokens=sum(plan.query_lens) + plan.padding,
    )
    step = Step(
        target,
        config,
        spec,
        backend,
        builder,
        plan,
        table,
        num_blocks,
        batch,
        label,
        generator=gen,
    )
    step.add_layer()
    return step


def engine_order(plan: BatchPlan, threshold: int | None) -> BatchPlan:
    """Decodes first when the builder asks for it (``reorder_batch_threshold``), as an engine
    reorders its batches before building."""
    if threshold is None:
        return plan
    order = sorted(range(len(plan.requests)), key=lambda r: plan.requests[r][0] > threshold)
    return replace(plan, requests=tuple(plan.requests[r] for r in order))


def random_block_table(
    plan: BatchPlan, block_size: int, gen: torch.Generator
) -> tuple[torch.Tensor, int]:  # ([num_reqs, max_blocks] int32 host, num_blocks)
    """Shuffled blocks. Block 0 pads rows and is never used, nor is the last block: a padding
    slot -1 misused as an index lands in one of them (clamped, or wrapped to the last slot), so
    such a write always shows. ``SPARE_BLOCKS`` blocks are left over in all. The first
    ``shared_prefix_blocks`` blocks are the same for every request (cascade)."""
    needed = [math.ceil(s / block_size) for s in plan.seq_lens]
    shared = plan.shared_prefix_blocks
    own = [n - shared for n in needed]
    num_blocks = 1 + shared + sum(own) + SPARE_BLOCKS
    ids = (torch.randperm(num_blocks - 2, generator=gen) + 1).tolist()  # not 0, not the last
    width = max(needed, default=0) + 1
    table = torch.zeros((len(needed), width), dtype=torch.int32)
    prefix, ids = ids[:shared], ids[shared:]
    for r, n in enumerate(own):
        table[r, :shared] = torch.tensor(prefix, dtype=torch.int32)
        table[r, shared : shared + n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    return table, num_blocks


def _randn(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def fill_garbage(cache: PagedKVCache, gen: torch.Generator) -> None:
    """Every slot and per-slot scale gets finite random bytes."""
    for plane in cache.planes().values():
        if plane.dtype == torch.int8:
            junk = torch.randint(-127, 128, plane.shape, generator=gen, dtype=torch.int8)
        elif plane.dtype == torch.float32 and plane.dim() == 3:  # a per-slot scale plane
            junk = torch.rand(plane.shape, generator=gen) * 0.04 + 0.01
        else:
            junk = torch.randn(plane.shape, generator=gen).clamp(-4, 4).to(plane.dtype)
        plane.copy_(junk.to(plane.device))


def set_static_scales(cache: PagedKVCache, gen: torch.Generator) -> None:
    """Engine-owned scales: fp8 per-tensor scales, int8 per-channel value scales."""
    fmt = KV_CACHE_DTYPES[cache.kv_cache_dtype]
    for which, fp8_scale in zip(("key_scale", "value_scale"), FP8_SCALES, strict=False):
        plane = getattr(cache, which)
        kind = getattr(fmt, which)
        if kind == "tensor":
            plane.fill_(fp8_scale)
        elif kind == "channel":  # 4.5-sigma values stay inside +-127 steps
            plane.copy_((torch.rand(plane.shape, generator=gen) * 0.015 + 0.035).to(plane.device))


def alibi_slopes(num_heads: int) -> torch.Tensor:  # [num_heads] float32
    """The ALiBi paper's geometric slopes (closest power of two, then interleaved)."""
    p = 2 ** math.floor(math.log2(num_heads))
    base = [2 ** (-8 * (i + 1) / p) for i in range(p)]
    extra = [2 ** (-4 * (2 * i + 1) / p) for i in range(num_heads - p)]
    return torch.tensor(base + extra, dtype=torch.float32)


def _make_layer(step: Step) -> Layer:
    spec, gen, dev = step.spec, step.generator, step.device
    slopes = alibi_slopes(spec.num_heads).to(dev) if spec.use_alibi else None
    sinks = (torch.randn(spec.num_heads, generator=gen) + 0.5).to(dev) if spec.use_sinks else None
    impl = step.backend.impl(alibi_slopes=slopes, sinks=sinks)
    cache = step.backend.allocate_kv_cache(step.num_blocks)
    fill_garbage(cache, gen)
    set_static_scales(cache, gen)
    t = step.batch.num_tokens
    H, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_size
    query = _randn((t, H, D), spec.dtype, gen).to(dev)
    key = _randn((t, Hkv, D), spec.dtype, gen).to(dev)
    value = _randn((t, Hkv, D), spec.dtype, gen).to(dev)
    layer = Layer(impl, cache, query, key, value, slopes, sinks)
    write_context(step, layer)
    return layer


def context_slots(step: Step) -> torch.Tensor:  # [n] int64, host: every slot of cached history
    """The slots of every position cached before this step (all of them for cross-attention);
    a shared prefix is listed once."""
    bs = step.spec.block_size
    slots: dict[int, None] = {}
    for r, (q, s) in enumerate(step.plan.requests):
        cached = s - q if step.plan.new_kv else s
        row = step.block_table[r].long()
        pos = torch.arange(cached)
        for slot in (row[pos // bs] * bs + pos % bs).tolist():
            slots[slot] = None
    return torch.tensor(list(slots), dtype=torch.int64)


def write_context(step: Step, layer: Layer) -> None:
    """Earlier steps' keys and values, written through the backend's own ``write_kv``."""
    slots = context_slots(step)
    if not slots.numel():
        return
    spec, gen, dev = step.spec, step.generator, step.device
    shape = (slots.numel(), spec.num_kv_heads, spec.head_size)
    key = _randn(shape, spec.dtype, gen).to(dev)
    value = _randn(shape, spec.dtype, gen).to(dev)
    layer.impl.write_kv(key, value, layer.cache, slots.to(dev))


# --- comparing with the reference ------------------------------------------------------------


def reference_output(
    step: Step, layer: Layer, batch: BatchMetadata | None = None, query: torch.Tensor | None = None
) -> torch.Tensor:  # [n, H, D] f64, host
    batch = step.batch if batch is None else batch
    query = layer.query if query is None else query
    out, _ = reference.paged_attention(
        query[: batch.num_actual_tokens],
        layer.cache,
        batch,
        step.spec,
        alibi_slopes=layer.alibi_slopes,
        sinks=layer.sinks,
    )
    return out


def token_origin(batch: BatchMetadata, t: int) -> str:
    """Where query row ``t`` comes from: its request and position."""
    qsl = batch.query_start_loc_cpu.tolist()
    for r in range(batch.num_reqs):
        if qsl[r] <= t < qsl[r + 1]:
            q = qsl[r + 1] - qsl[r]
            s = int(batch.seq_lens_cpu[r])
            i = t - qsl[r]
            return f"request {r} (query_len {q}, seq_len {s}), query {i}, position {s - q + i}"
    return "a padding row"


def mismatch(
    got: torch.Tensor,  # [n, H, D]
    want: torch.Tensor,  # [n, H, D] f64
    atol: float,
    rtol: float,
    batch: BatchMetadata,
) -> str | None:
    """None when ``|got - want| <= atol + rtol * |want|`` everywhere (and nothing is NaN);
    otherwise a sentence naming the worst element and the requests affected."""
    g = got.detach().to("cpu", torch.float64)
    if g.shape != want.shape:
        return f"shape {list(g.shape)}, expected {list(want.shape)}"
    excess = (g - want).abs() - (atol + rtol * want.abs())
    bad = (excess > 0) | torch.isnan(g)
    if not bool(bad.any()):
        return None
    score = torch.where(torch.isnan(g), torch.full_like(excess, math.inf), excess)
    t, h, d = (int(i) for i in torch.unravel_index(torch.argmax(score), score.shape))
    qsl = batch.query_start_loc_cpu
    rows = bad.flatten(1).any(1).nonzero()[:, 0]
    reqs = sorted({int(torch.searchsorted(qsl, r, right=True)) - 1 for r in rows.tolist()})
    return (
        f"{int(bad.sum())} of {bad.numel()} elements outside atol={atol:g} + rtol={rtol:g}*|ref|; "
        f"worst at token {t} ({token_origin(batch, t)}), head {h}, channel {d}: got "
        f"{float(g[t, h, d]):.6g}, expected {float(want[t, h, d]):.6g}; requests with errors: "
        f"{reqs[:12]}{' ...' if len(reqs) > 12 else ''}"
    )


def tolerance(step: Step) -> tuple[float, float]:
    tol = step.backend.capabilities.tolerance(step.spec.dtype)
    return tol.atol, tol.rtol


def assert_matches_reference(
    step: Step, layer: Layer, out: torch.Tensor, what: str = "forward"
) -> None:
    """``out`` equals the reference within the declared tolerance; padding rows are zero."""
    assert out.shape == layer.query.shape, (
        f"{step.label}: {what} returned shape {list(out.shape)}, expected {list(layer.query.shape)}"
    )
    assert out.dtype == step.spec.dtype, (
        f"{step.label}: {what} returned {out.dtype}, expected {step.spec.dtype}"
    )
    atol, rtol = tolerance(step)
    n = step.n
    why = mismatch(out[:n], reference_output(step, layer), atol, rtol, step.batch)
    assert why is None, (
        f"{step.label}: {what} differs from attnhub.reference ({step.spec.dtype}): {why}"
    )
    pad = out[n:].detach().to("cpu")
    assert bool((pad == 0).all()), (
        f"{step.label}: padding rows {n}..{out.shape[0] - 1} must come back as zeros"
    )


# --- comparing caches ------------------------------------------------------------------------


def _slot_bytes(cache: PagedKVCache, name: str) -> torch.Tensor:  # [num_slots, bytes] uint8
    plane: torch.Tensor | None
    if name in ("key", "value"):
        plane = cache.key_nhd() if name == "key" else cache.value_nhd()
    else:
        plane = cache.slot_scale_nhd(name)
    assert plane is not None, f"the cache has no {name} plane"
    return plane.to("cpu").reshape(cache.num_slots, -1).contiguous().view(torch.uint8)


def _describe_slots(cache: PagedKVCache, slots: list[int]) -> str:
    bs = cache.block_size
    shown = ", ".join(f"{s} (block {s // bs}, offset {s % bs})" for s in slots[:6])
    more = f" and {len(slots) - 6} more" if len(slots) > 6 else ""
    hint = ""
    if cache.num_slots - 1 in slots:
        hint = " [the last slot changed: a padding slot -1 used as an index wraps to it]"
    return shown + more + hint


def _dequantized_tolerance(
    cache: PagedKVCache, which: str, want: torch.Tensor, expected: PagedKVCache
) -> torch.Tensor:
    """How far a backend's stored value may sit from the reference's: one quantization step
    (rounding may legitimately differ), per element of ``want`` [num_slots, Hkv, D]."""
    fmt = KV_CACHE_DTYPES[cache.kv_cache_dtype]
    kind = getattr(fmt, f"{which}_scale")
    plane = getattr(expected, which)
    if kind == "tensor":  # fp8: one ulp relative, plus the smallest subnormal
        fp8 = plane.dtype
        mant = 3 if fp8 == torch.float8_e4m3fn else 2
        tiny = float(torch.finfo(fp8).smallest_normal) * 2.0**-mant
        scale = float(getattr(expected, f"{which}_scale").to("cpu"))
        return 2.0**-mant * want.abs() + scale * tiny
    # int8: one step of the (reference's) scale
    if kind == "slot":
        per_slot = expected.slot_scale_nhd(f"{which}_scale")
        assert per_slot is not None
        step = per_slot.to("cpu", torch.float64).reshape(cache.num_slots, -1)[..., None]
    else:
        step = getattr(expected, f"{which}_scale").to("cpu", torch.float64)[None]
    return 1.01 * step + 1e-3 * want.abs()


def cache_differences(
    actual: PagedKVCache, expected: PagedKVCache, written: torch.Tensor
) -> list[str]:
    """What differs between ``actual`` and ``expected`` (the reference's write applied to a
    clone taken before the call). ``written``: the slots the call had to write.

    Slots not written must be byte-identical. Written slots must be byte-identical for
    unquantized caches; for quantized ones, their dequantized values must agree within one
    quantization step. Engine-owned scales must not change.
    """
    problems: list[str] = []
    fmt = KV_CACHE_DTYPES[expected.kv_cache_dtype]
    is_written = torch.zeros(actual.num_slots, dtype=torch.bool)
    w = written.to("cpu").long()
    is_written[w[w >= 0]] = True
    for name in actual.planes():
        a, e = _slot_bytes(actual, name), _slot_bytes(expected, name)
        differs = (a != e).any(dim=1)
        untouched = (differs & ~is_written).nonzero()[:, 0].tolist()
        if untouched:
            problems.append(
                f"{name} changed in slots this call must not write: "
                + _describe_slots(actual, untouched)
            )
        wrong = (differs & is_written).nonzero()[:, 0].tolist()
        if wrong and not fmt.is_quantized:
            problems.append(
                f"{name} holds other values than were written, in slots "
                + _describe_slots(actual, wrong)
            )
    for which in ("key_scale", "value_scale"):  # engine-owned static scales
        kind = getattr(fmt, which)
        if kind in ("tensor", "channel") and not torch.equal(
            getattr(actual, which).to("cpu"), getattr(expected, which).to("cpu")
        ):
            problems.append(f"the engine-owned {kind} {which} was modified")
    if fmt.is_quantized and is_written.any():
        everything = torch.arange(actual.num_blocks)
        got_k, got_v = reference.read_sequence(actual, everything, actual.num_slots)
        want_k, want_v = reference.read_sequence(expected, everything, actual.num_slots)
        for which, got, want in (("key", got_k, want_k), ("value", got_v, want_v)):
            if getattr(fmt, f"{which}_scale") == "none":
                continue
            tol = _dequantized_tolerance(actual, which, want, expected)
            bad = (((got - want).abs() > tol) | torch.isnan(got)).flatten(1).any(1) & is_written
            slots = bad.nonzero()[:, 0].tolist()
            if slots:
                s = slots[0]
                err = float((got[s] - want[s]).abs().max())
                problems.append(
                    f"dequantized {which} differs from the reference's quantization by more than "
                    f"one step in slots {_describe_slots(actual, slots)} (slot {s}: max |diff| "
                    f"{err:.4g})"
                )
    return problems


def expected_after_write(
    before: PagedKVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> PagedKVCache:
    expected = before.clone()
    reference.write_kv(expected, key, value, slot_mapping)
    return expected


# --- sub-batches (batch invariance) ------------------------------------------------------------


def sub_batch(
    step: Step, layer: Layer, order: list[int]
) -> tuple[BatchMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The requests ``order`` (old indices) as a batch of their own, same slots and inputs:
    ``(batch, query, key, value, rows)`` where ``rows`` are their rows in the original."""
    qsl = step.batch.query_start_loc_cpu.tolist()
    rows = torch.cat([torch.arange(qsl[r], qsl[r + 1]) for r in order])
    batch = BatchMetadata.from_lengths(
        [step.plan.requests[r][0] for r in order],
        [step.plan.requests[r][1] for r in order],
        step.block_table[order],
        step.spec.block_size,
        step.device,
        causal=step.spec.causal,
    )
    dev_rows = rows.to(step.device)
    return (batch, layer.query[dev_rows], layer.key[dev_rows], layer.value[dev_rows], rows)
