"""MLA layers, the absorbed form (``Capabilities.mla``): outputs and LSE against
``attnhub.reference.paged_mla_absorbed``, the latent write byte for byte against
``attnhub.reference.write_latent_kv`` (fp8: and against vLLM's bytes, ``mla_fp8``), bad input
refused with the cache byte-identical, and what is not declared refused with reasons (cases:
``attnhub_conformance.mla_cases``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from attnhub import BatchMetadata, LatentKVCache, reference, testing
from attnhub.errors import (
    AttnhubError,
    InvalidInputError,
    UnsupportedConfigurationError,
)
from attnhub.mla import LATENT_LAYOUTS, MLASpec
from attnhub.quant import simulate_query_quantization
from attnhub_conformance import mla_fp8
from attnhub_conformance.mla_cases import MLACase

SPARE_BLOCKS = 2  # blocks no request uses: stale data the step must neither read nor write


@dataclass
class MLAStep:
    case: MLACase
    spec: MLASpec
    backend: Any
    batch: BatchMetadata
    cache: LatentKVCache
    query: torch.Tensor  # [T, H, R + P]
    kv_c: torch.Tensor  # [T, R]
    k_pe: torch.Tensor  # [T, P]
    impl: Any
    label: str

    @property
    def device(self) -> torch.device:
        return torch.device(self.case.target.device)


def _on_host(cache: LatentKVCache) -> LatentKVCache:
    """A host copy of ``cache`` in its layout (the reference reads host tensors)."""
    scale = None if cache.scale is None else cache.scale.to("cpu").clone()
    if cache.layout == "joint":
        return LatentKVCache.from_joint(
            cache.joint.to("cpu").clone(),
            cache.kv_lora_rank,
            kv_cache_dtype=cache.kv_cache_dtype,
            scale=scale,
        )
    return replace(
        cache, kv_c=cache.kv_c.to("cpu").clone(), k_pe=cache.k_pe.to("cpu").clone(), scale=scale
    )


def prepare(case: MLACase) -> MLAStep:
    assert case.mla is not None and case.batch_plan is not None
    config, plan = case.mla, case.batch_plan
    spec = config.spec()
    device = case.target.device
    backend = case.target.create(spec)  # type: ignore[arg-type]
    g = testing.generator(testing.seed_of(f"mla-{case.name}"))
    n = sum(plan.query_lens)
    batch, nb = testing.make_batch(
        plan.query_lens,
        plan.seq_lens,
        spec.block_size,
        seed=g,
        num_tokens=n + plan.padding,
        device=device,
    )
    cache = LatentKVCache.for_spec(spec, nb + SPARE_BLOCKS, device, layout=config.layout)
    testing.fill_latent_cache_random(cache, g)  # context and stale slots alike
    T = batch.num_tokens
    kv_c, k_pe = testing.random_latent_kv(spec, T, g, device=device)
    query = testing.random_mla_query(spec, T, g, device=device)
    return MLAStep(
        case, spec, backend, batch, cache, query, kv_c, k_pe, backend.impl(), f"{case.id}"
    )


def expected_after_write(step: MLAStep) -> LatentKVCache:
    want = _on_host(step.cache)
    reference.write_latent_kv(
        want, step.kv_c.to("cpu"), step.k_pe.to("cpu"), step.batch.slot_mapping.to("cpu")
    )
    return want


def tolerance(step: MLAStep) -> Any:
    caps = step.backend.capabilities
    return caps.mla.tolerance(step.spec.dtype, caps.tolerances)


def assert_written_exactly(step: MLAStep, want: LatentKVCache) -> None:
    got = _on_host(step.cache)
    assert got.equal(want), (
        f"{step.label}: the latent cache differs from attnhub.reference.write_latent_kv's "
        "(each token's (kv_c, k_pe) at its slot, padding skipped, nothing else touched)"
    )
    assert_vllm_fp8_bytes(step.label, got, step.kv_c, step.k_pe, step.batch.slot_mapping)


def assert_vllm_fp8_bytes(
    label: str,
    got: LatentKVCache,  # on the host
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """fp8: each written slot holds the bytes vLLM's ``concat_and_cache_mla`` stores for its
    token (``attnhub_conformance.mla_fp8``, apart from ``attnhub.quant``)."""
    if got.scale is None:
        return
    fmt = mla_fp8.FP8_FORMATS[got.kv_cache_dtype]
    slots = slot_mapping.to("cpu").long()
    rows = (slots >= 0).nonzero()[:, 0]
    slots = slots[rows]
    blocks, offsets = slots // got.block_size, slots % got.block_size
    scale = float(got.scale)
    for name, new, plane in (("kv_c", kv_c, got.kv_c), ("k_pe", k_pe, got.k_pe)):
        want = mla_fp8.encode(new.to("cpu")[rows], scale, fmt)
        stored = plane.view(torch.uint8)[blocks, offsets]
        bad = (stored != want).nonzero()
        if bad.numel():
            i, j = (int(x) for x in bad[0])
            value = float(new.to("cpu")[rows[i], j])
            raise AssertionError(
                f"{label}: {(stored != want).sum()} bytes of the written {name} differ from "
                f"vLLM's fp8 write (concat_and_cache_mla: fp8(x / scale), nearest even, "
                f"saturated); first: token {int(rows[i])} column {j}, x = {value!r}, scale "
                f"{scale!r}: stored 0x{int(stored[i, j]):02x} ({fmt.decode(int(stored[i, j]))!r})"
                f", vLLM stores 0x{int(want[i, j]):02x} ({fmt.decode(int(want[i, j]))!r})"
            )


def assert_output(step: MLAStep, out: torch.Tensor) -> None:
    """The output against the reference over the latents as stored, for the query as the
    kernels use it (quantized where ``Capabilities.mla.query_quantization`` declares it for the
    format), within the declared tolerance plus what a declared rounding of the probabilities
    can change (``testing.mla_probability_allowance``); where the format declares an accuracy
    bound, within it of the reference over the unquantized query."""
    n = step.batch.num_actual_tokens
    host = _on_host(step.cache)
    mla, kv = step.backend.capabilities.mla, step.spec.kv_cache_dtype
    query = step.query[:n].to("cpu")
    scheme = mla.query_quantization.get(kv)
    kernel_query = query if scheme is None else simulate_query_quantization(query, scheme)
    want, _ = reference.paged_mla_absorbed(kernel_query, host, step.batch, step.spec)
    shape = (step.query.shape[0], step.spec.num_heads, step.spec.kv_lora_rank)
    assert tuple(out.shape) == shape and out.dtype == step.spec.dtype, (
        f"{step.label}: the output must be {step.spec.dtype} {list(shape)}, got {out.dtype} "
        f"{list(out.shape)}"
    )
    tol = tolerance(step)
    rounding = mla.probability_quantization.get(kv)
    allowance = (
        None
        if rounding is None
        else testing.mla_probability_allowance(kernel_query, host, step.batch, step.spec, rounding)
    )
    why = testing.mismatch(out[:n].to("cpu"), want, tol, step.batch, allowance=allowance)
    assert why is None, (
        f"{step.label}: the latent output differs from attnhub.reference's absorbed MLA "
        f"(declared tolerance atol={tol.atol:g} rtol={tol.rtol:g}"
        + ("" if scheme is None else f", the query quantized {scheme}")
        + ("" if rounding is None else f", plus what {rounding} probabilities can change")
        + f"): {why}"
    )
    bound = mla.quantization_accuracy.get(kv)
    if bound is not None:
        exact, _ = reference.paged_mla_absorbed(query, host, step.batch, step.spec)
        why = testing.accuracy_mismatch(out[:n].to("cpu"), exact, bound, step.batch)
        assert why is None, (
            f"{step.label}: over {kv} latents the output is further from the absorbed form "
            f"over the unquantized query than declared (MlaSupport.quantization_accuracy): {why}"
        )
    assert bool((out[n:] == 0).all()), f"{step.label}: padding rows of the output are not zero"


@pytest.mark.attnhub_cases("mla")
def test_mla(case: MLACase) -> None:
    entry = case.entry
    if entry in ("undeclared", "refused", "refused_here"):
        _check_refused(case)
        return
    if entry == "kv_write_fp8":
        _check_fp8_write(case)
        return
    step = prepare(case)
    meta_builder = step.backend.metadata_builder()
    if entry == "refused_query_len":
        with pytest.raises(UnsupportedConfigurationError, match="query_len"):
            meta_builder.build(step.batch)
        return
    meta = meta_builder.build(step.batch)
    if entry == "output":
        want = expected_after_write(step)
        out = step.impl.forward(step.query, step.kv_c, step.k_pe, step.cache, meta)
        assert_written_exactly(step, want)
        assert_output(step, out)
        return
    if entry in ("lse", "lse_refused"):
        _check_lse(step, meta, refused=entry == "lse_refused")
        return
    _check_invalid(step, meta, entry)


def _check_refused(case: MLACase) -> None:
    assert case.mla is not None
    spec = case.mla.spec()
    reasons = case.target.refusal(spec)  # type: ignore[arg-type]
    # a device's refusal (entry "refused_here") may come at construction alone
    assert reasons or case.entry == "refused_here", (
        f"{case.id}: {spec} is not declared, yet unsupported_reasons is empty"
    )
    with pytest.raises(UnsupportedConfigurationError) as err:
        case.target.create(spec)  # type: ignore[arg-type]
    assert not reasons or str(reasons[0]) in str(err.value), (
        f"{case.id}: construction refused without the reason {reasons[0]!r}: {err.value}"
    )


#: The fp8 edge-value write's cache scale: not 1 (a write that ignores it fails), a power of two
#: (``x / scale`` exact, so that the ties between two fp8 values stay ties).
EDGE_SCALE = 0.125


def _check_fp8_write(case: MLACase) -> None:
    """``write_kv`` of edge values (every fp8 value, every midpoint, beyond the largest value,
    below the smallest) over a random fp8 latent cache: the bytes vLLM stores, nothing else
    touched."""
    assert case.mla is not None
    spec, device = case.mla.spec(), case.target.device
    backend = case.target.create(spec)  # type: ignore[arg-type]
    fmt = mla_fp8.FP8_FORMATS[spec.kv_cache_dtype]
    edges = mla_fp8.edge_values(fmt, EDGE_SCALE)
    g = testing.generator(testing.seed_of(f"mla-{case.name}"))
    width = spec.latent_size
    n = -(-edges.numel() // width)  # written tokens: every edge value at least once
    values = edges[torch.arange(n * width) % edges.numel()]
    values = values[torch.randperm(values.numel(), generator=g)].reshape(n, width)
    values = torch.cat([values[:1], -values]).to(spec.dtype)  # row 0: padding, not written
    kv_c = values[:, : spec.kv_lora_rank].contiguous().to(device)
    k_pe = values[:, spec.kv_lora_rank :].contiguous().to(device)
    num_blocks = -(-(n + 3) // spec.block_size) + 1  # spare slots: stale data to leave alone
    cache = LatentKVCache.for_spec(spec, num_blocks, device, layout=case.mla.layout)
    testing.fill_latent_cache_random(cache, g, fp8_scale=EDGE_SCALE)
    picked = torch.randperm(cache.num_slots, generator=g)[:n]
    slots = torch.cat([torch.tensor([-1]), picked]).to(device)
    label = case.id
    want = _on_host(cache)
    reference.write_latent_kv(want, kv_c.to("cpu"), k_pe.to("cpu"), slots.to("cpu"))
    impl: Any = backend.impl()  # an MLAImpl (the spec is an MLASpec)
    impl.write_kv(kv_c, k_pe, cache, slots)
    got = _on_host(cache)
    assert_vllm_fp8_bytes(label, got, kv_c, k_pe, slots)
    assert got.equal(want), (
        f"{label}: the fp8 latent cache differs from attnhub.reference.write_latent_kv's "
        "outside the written slots or in its scale"
    )


def _check_lse(step: MLAStep, meta: Any, *, refused: bool) -> None:
    if refused:
        before = _on_host(step.cache)
        with pytest.raises(UnsupportedConfigurationError, match="return_lse"):
            step.impl.forward(step.query, step.kv_c, step.k_pe, step.cache, meta, return_lse=True)
        assert _on_host(step.cache).equal(before), f"{step.label}: a refused call wrote"
        return
    want_cache = expected_after_write(step)
    out, lse = step.impl.forward(
        step.query, step.kv_c, step.k_pe, step.cache, meta, return_lse=True
    )
    assert_written_exactly(step, want_cache)
    assert_output(step, out)
    n, H = step.batch.num_actual_tokens, step.spec.num_heads
    assert tuple(lse.shape) == (step.query.shape[0], H) and lse.dtype == torch.float32, (
        f"{step.label}: the LSE must be float32 [num_tokens, num_heads], got {lse.dtype} "
        f"{list(lse.shape)}"
    )
    _, want = reference.paged_mla_absorbed(
        step.query.to("cpu"), _on_host(step.cache), step.batch, step.spec
    )
    why = testing.mismatch(lse[:n].to("cpu"), want.t(), tolerance(step))
    assert why is None, f"{step.label}: the LSE differs from the reference's: {why}"
    assert bool(torch.isposinf(lse[n:]).all()), f"{step.label}: padding LSE rows are not +inf"


def _provoke(step: MLAStep, meta: Any, entry: str) -> None:
    """One bad call (``mla_cases.INVALID``)."""
    s, q, kv_c, k_pe, cache = step.spec, step.query, step.kv_c, step.k_pe, step.cache
    impl, dev = step.impl, step.device

    def widened(t: torch.Tensor, cols: int) -> torch.Tensor:
        return torch.zeros(t.shape[0], cols, dtype=t.dtype, device=t.device)

    if entry == "latent_too_wide":
        impl.forward(q, widened(kv_c, s.kv_lora_rank + 1), k_pe, cache, meta)
    elif entry == "rope_missing":
        impl.forward(q, kv_c, None, cache, meta)
    elif entry == "rope_too_narrow":
        impl.forward(q, kv_c, widened(k_pe, s.qk_rope_head_dim - 1), cache, meta)
    elif entry == "latent_wrong_dtype":
        dtype = torch.float32 if s.dtype != torch.float32 else torch.float16
        impl.forward(q, kv_c.to(dtype), k_pe, cache, meta)
    elif entry == "query_expanded_width":
        g = testing.generator(1)
        wide = testing.random_mla_query(s, q.shape[0], g, form="expanded", device=dev)
        impl.forward(wide, kv_c, k_pe, cache, meta)
    elif entry == "output_wrong_width":
        buf = torch.zeros(q.shape[0], s.num_heads, s.v_head_dim, dtype=s.dtype, device=dev)
        impl.forward(q, kv_c, k_pe, cache, meta, output=buf)
    elif entry == "cache_other_block_size":
        bigger = LatentKVCache.allocate(
            cache.num_blocks, s.block_size * 2, s.kv_lora_rank, s.qk_rope_head_dim, s.dtype,
            dev, layout=cache.layout, kv_cache_dtype=s.kv_cache_dtype,
        )  # fmt: skip
        impl.forward(q, kv_c, k_pe, bigger, meta)
    elif entry == "cache_undeclared_layout":
        layouts = step.backend.capabilities.mla.layouts
        layout = next(x for x in LATENT_LAYOUTS if x not in layouts)
        undeclared = LatentKVCache.for_spec(s, cache.num_blocks, dev, layout=layout)
        impl.forward(q, kv_c, k_pe, undeclared, meta)
    elif entry == "cache_other_format":
        other = "fp8_e4m3" if s.kv_cache_dtype == "auto" else "auto"
        wrong = LatentKVCache.allocate(
            cache.num_blocks, s.block_size, s.kv_lora_rank, s.qk_rope_head_dim, s.dtype,
            dev, layout=cache.layout, kv_cache_dtype=other,
        )  # fmt: skip
        impl.forward(q, kv_c, k_pe, wrong, meta)
    elif entry == "meta_of_other_spec":
        other_spec = replace(s, block_size=s.block_size * 2)
        other_backend = step.case.target.create(other_spec)  # type: ignore[arg-type]
        batch, _ = testing.make_batch([1], [3], other_spec.block_size, device=dev)
        other_meta = other_backend.metadata_builder().build(batch)
        impl.forward(q[:1], kv_c[:1], k_pe[:1], cache, other_meta)
    elif entry == "write_kv_slot_outside":
        slots = torch.full((kv_c.shape[0],), -1, dtype=torch.int64, device=dev)
        slots[0] = cache.num_slots
        impl.write_kv(kv_c, k_pe, cache, slots)
    else:
        raise AssertionError(f"unknown invalid-input entry {entry!r}")


def _check_invalid(step: MLAStep, meta: Any, entry: str | None) -> None:
    assert entry is not None
    before = _on_host(step.cache)
    raised: BaseException | None = None
    try:
        _provoke(step, meta, entry)
    except Exception as exc:
        raised = exc
    problems = []
    if raised is None:
        problems.append("no error was raised (expected attnhub.errors.InvalidInputError)")
    elif not isinstance(raised, (InvalidInputError, AttnhubError)):
        problems.append(f"raised {type(raised).__name__}({raised}), not an attnhub error")
    elif not str(raised).strip():
        problems.append(f"{type(raised).__name__} was raised without a message")
    if not _on_host(step.cache).equal(before):
        problems.append("the latent cache changed")
    assert not problems, f"{step.label}: {entry}: " + "; ".join(problems)
