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
    (its quantization included), and, where the backend declares that its kernels quantize
    the query for the cache's format (``Capabilities.query_quantization``), takes the query so
    quantized: the "same inputs" comparison, at the tight tolerance; where it declares that
    they round the softmax probabilities (``Capabilities.probability_quantization``), the
    tolerance grows by what that rounding can change (``testing.probability_allowance``) and
    the rounding check compares with a plain computation that rounds them too;
  - the keys and values written are kept, so that a quantized cache's output can also be
    compared with attention over the unquantized inputs (``unquantized_reference``), within
    the backend's declared ``quantization_accuracy``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from attnhub import AttentionSpec, BatchMetadata, PagedKVCache, Tolerance, reference, testing
from attnhub.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
)
from attnhub_conformance.cases import BatchPlan, Case, Config
from attnhub_conformance.targets import Target

SPARE_BLOCKS = 3  # blocks no request uses (the last among them): they stay untouched


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
    #: The cached context as written before the step (unquantized): its slots, keys, values.
    context_slots: torch.Tensor | None = None  # [c] int64, host
    context_key: torch.Tensor | None = None  # [c, num_kv_heads, head_size]
    context_value: torch.Tensor | None = None


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
    gen = testing.generator(testing.seed_of(label))
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
    shared = plan.shared_prefix_blocks
    num_blocks = testing.num_blocks_for(
        plan.seq_lens, block_size, SPARE_BLOCKS, shared_prefix_blocks=shared
    )
    table = testing.shuffled_block_table(
        plan.seq_lens,
        block_size,
        num_blocks,
        gen,
        extra_width=1,
        shared_prefix_blocks=shared,
        keep_last_block_free=True,
    )
    return table, num_blocks


def _make_layer(step: Step) -> Layer:
    """Per-layer weights, a cache of finite garbage (engine-owned scales set), this step's
    inputs, and the cached context written through the backend's own ``write_kv``."""
    spec, gen, dev = step.spec, step.generator, step.device
    slopes = testing.alibi_slopes(spec.num_heads, device=dev) if spec.use_alibi else None
    sinks = (
        testing.random_sinks(spec.num_heads, gen, mean=0.5, device=dev) if spec.use_sinks else None
    )
    impl = step.backend.impl(alibi_slopes=slopes, sinks=sinks)
    cache = step.backend.allocate_kv_cache(step.num_blocks)
    testing.fill_cache_random(cache, gen)
    query, key, value = testing.random_qkv(spec, step.batch.num_tokens, gen, device=dev)
    layer = Layer(impl, cache, query, key, value, slopes, sinks)
    write_context(step, layer)
    return layer


def context_slots(step: Step) -> torch.Tensor:  # [n] int64, host: every slot of cached history
    """The slots of every position cached before this step (all of them for cross-attention);
    a shared prefix is listed once."""
    return testing.used_slots(step.batch, context_only=step.plan.new_kv)


def write_context(step: Step, layer: Layer) -> None:
    """Earlier steps' keys and values, written through the backend's own ``write_kv``."""
    slots = context_slots(step)
    if not slots.numel():
        return
    key, value = testing.random_kv(step.spec, slots.numel(), step.generator, device=step.device)
    layer.impl.write_kv(key, value, layer.cache, slots.to(step.device))
    layer.context_slots, layer.context_key, layer.context_value = slots, key, value


# --- comparing with the reference ------------------------------------------------------------


def reference_output(
    step: Step,
    layer: Layer,
    batch: BatchMetadata | None = None,
    query: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype = torch.float64,
    round_probabilities: bool = False,
    allowance: bool = False,
) -> torch.Tensor:  # [n, H, D] f64, host
    """The reference over the cache as stored, for the query as the backend's kernels use it
    (``testing.quantized_query``: quantized where the backend declares it for this cache).
    ``round_probabilities``: with the probabilities rounded as the backend declares
    (``testing.probability_rounding``); ``allowance``: instead, what that rounding can change
    per element (``testing.probability_allowance``)."""
    batch = step.batch if batch is None else batch
    query = layer.query if query is None else query
    caps, kv = step.backend.capabilities, step.spec.kv_cache_dtype
    query = testing.quantized_query(query[: batch.num_actual_tokens], caps, kv)
    if allowance:
        return testing.probability_allowance(
            query,
            layer.cache,
            batch,
            step.spec,
            caps.probability_quantization[kv],
            alibi_slopes=layer.alibi_slopes,
            sinks=layer.sinks,
        )
    out, _ = reference.paged_attention(
        query,
        layer.cache,
        batch,
        step.spec,
        alibi_slopes=layer.alibi_slopes,
        sinks=layer.sinks,
        compute_dtype=compute_dtype,
        probabilities=testing.probability_rounding(caps, kv) if round_probabilities else None,
    )
    return out


def unquantized_reference(step: Step, layer: Layer) -> torch.Tensor:  # [n, H, D] f64, host
    """Attention over the inputs before any quantization: the original query, and the keys and
    values written (context and new tokens) as given, in an unquantized cache."""
    spec = replace(step.spec, kv_cache_dtype="auto")
    cache = PagedKVCache.for_spec(spec, step.num_blocks, "cpu")
    if layer.context_slots is not None:
        assert layer.context_key is not None and layer.context_value is not None
        reference.write_kv(cache, layer.context_key, layer.context_value, layer.context_slots)
    if step.plan.new_kv:
        reference.write_kv(cache, layer.key, layer.value, step.batch.slot_mapping)
    batch = step.batch
    out, _ = reference.paged_attention(
        layer.query[: batch.num_actual_tokens],
        cache,
        batch,
        spec,
        alibi_slopes=layer.alibi_slopes,
        sinks=layer.sinks,
    )
    return out


def assert_accurate(step: Step, layer: Layer, out: torch.Tensor) -> None:
    """``out`` is within the declared ``quantization_accuracy`` of attention over the
    unquantized inputs (max abs error and min cosine similarity per token)."""
    kv = step.spec.kv_cache_dtype
    caps = step.backend.capabilities
    bound = caps.quantization_accuracy.get(kv)
    assert bound is not None, (
        f"{step.label}: the backend declares kv_cache_dtype {kv!r} but no accuracy bound for "
        "it (Capabilities.quantization_accuracy: max abs error and min cosine similarity vs "
        "attention over the unquantized inputs)"
    )
    want = unquantized_reference(step, layer)
    why = testing.accuracy_mismatch(out[: step.n], want, bound, step.batch)
    assert why is None, (
        f"{step.label}: forward over a {kv} cache is further from attention over the "
        f"unquantized inputs than declared: {why}"
    )


def tolerance(step: Step) -> Tolerance:
    """What the backend declares for the step's dtype; a declaration missing, or looser than
    the suite's cap (``attnhub.testing.TOLERANCE_CAPS``), fails the case."""
    dtype = step.spec.dtype
    declared = step.backend.capabilities.tolerances.get(dtype)
    assert declared is not None, (
        f"{step.label}: the backend declares dtype {dtype} but no tolerance for it "
        "(Capabilities.tolerances)"
    )
    capped = testing.capped_tolerance(declared, dtype)
    assert capped is not None, (
        f"{step.label}: the backend declares tolerance atol={declared.atol:g} "
        f"rtol={declared.rtol:g} for {dtype}, looser than the suite accepts "
        f"({testing.TOLERANCE_CAPS[dtype]}): a backend may be tighter, never looser"
    )
    return capped


def output_shape(step: Step, layer: Layer) -> tuple[int, int, int]:
    """What forward returns: [num_tokens, num_heads, head_size_v] (the query's shape where
    values are as wide as keys)."""
    return (layer.query.shape[0], step.spec.num_heads, step.spec.head_size_v)


def assert_matches_reference(
    step: Step, layer: Layer, out: torch.Tensor, what: str = "forward"
) -> None:
    """``out`` equals the reference within the declared tolerance; padding rows are zero."""
    want = output_shape(step, layer)
    assert out.shape == want, (
        f"{step.label}: {what} returned shape {list(out.shape)}, expected {list(want)}"
    )
    assert out.dtype == step.spec.dtype, (
        f"{step.label}: {what} returned {out.dtype}, expected {step.spec.dtype}"
    )
    n = step.n
    tol, dtype = tolerance(step), step.spec.dtype
    exact = reference_output(step, layer)
    said = f"declared tolerance atol={tol.atol:g} rtol={tol.rtol:g}"
    # kernels that round the probabilities (declared): what that can change is allowed too,
    # and "a plain computation" rounds them as well (as FlashAttention-3's own fp8 tests do)
    rounds_p = step.spec.kv_cache_dtype in step.backend.capabilities.probability_quantization
    if rounds_p:
        said += " + the declared probability rounding's bound"
    allowance = reference_output(step, layer, allowance=True) if rounds_p else None
    why = testing.mismatch(out[:n], exact, tol, step.batch, allowance=allowance)
    assert why is None, (
        f"{step.label}: {what} differs from attnhub.reference ({dtype}, {said}): {why}"
    )
    rounded = reference_output(step, layer, compute_dtype=dtype, round_probabilities=rounds_p)
    plain = None
    if rounds_p:
        scheme = step.backend.capabilities.probability_quantization[step.spec.kv_cache_dtype]
        plain = (
            f"a plain {str(dtype).removeprefix('torch.')} computation rounding its "
            f"probabilities as declared ({scheme})"
        )
    why = testing.rounding_mismatch(out[:n], exact, rounded, dtype, plain=plain)
    assert why is None, f"{step.label}: {what} ({dtype}, {said}): {why}"
    pad = out[n:].detach().to("cpu")
    assert bool((pad == 0).all()), (
        f"{step.label}: padding rows {n}..{out.shape[0] - 1} must come back as zeros"
    )


def with_tensors(batch: BatchMetadata, **tensors: torch.Tensor) -> BatchMetadata:
    """The batch with ``tensors`` (its device tensors by field name: ``slot_mapping=...``)
    replaced, and each one's host copy (``slot_mapping_cpu``), where the batch carries one,
    replaced by the same values: an engine's two copies agree, and a builder checks the host
    copy. A spoiled device copy beside an intact host copy is a contradiction no builder can
    see without reading device memory; on an accelerator its kernels then index with the
    unchecked values (CUDA: a device-side assert, which ends the process's CUDA context)."""
    changes: dict[str, Any] = dict(tensors)
    for name, t in tensors.items():
        if getattr(batch, name + "_cpu", None) is not None:
            changes[name + "_cpu"] = t.cpu()
    return replace(batch, **changes)


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
