"""What a static scale that does not cover the values costs: the table in docs/concepts.md.

    python benchmarks/clipping_cost.py

One step of four requests (prefills, decodes, a chunk; 688 tokens, 2 kv heads of 128) whose
keys and values are N(0, 1), written and attended in one forward on CPU (vendor backends
through their emulators), with static scales from ``attnhub.quant.calibrate_kv_scales`` over
the step's own K/V, then with scales too small for the values. Each row: max abs error and min
cosine of the output against the float64 reference over the unquantized inputs, and what
``attnhub.quant.ClipCounter`` counted. Deterministic (fixed seeds); no timing.
"""

from __future__ import annotations

import dataclasses

import torch

import attnhub
from attnhub import quant, reference
from attnhub.testing import accuracy, generator, make_batch

HKV, D, BS = 2, 128, 16
REQUESTS = [64, 300, 129, 200]  # every request's whole sequence, written in this one step


def measure(backend: str, kv: str, scale: float | None) -> tuple[float, float, quant.ClipCount]:
    """``scale``: the static scale(s) to set, None for calibrated ones."""
    spec = attnhub.AttentionSpec(
        num_heads=8, num_kv_heads=HKV, head_size=D, dtype=torch.bfloat16, block_size=BS,
        kv_cache_dtype=kv,
    )  # fmt: skip
    be = attnhub.select_backend(spec, "cpu", prefer=backend, emulate=True)
    g = generator(0)
    batch, num_blocks = make_batch(REQUESTS, REQUESTS, BS, seed=g)
    T = batch.num_tokens
    q = torch.randn(T, 8, D, generator=g).bfloat16()
    k = torch.randn(T, HKV, D, generator=g).bfloat16()
    v = torch.randn(T, HKV, D, generator=g).bfloat16()
    cache = be.allocate_kv_cache(num_blocks)
    calibrated = quant.calibrate_kv_scales(kv, k, v)
    for plane, fitted in zip((cache.key_scale, cache.value_scale), calibrated, strict=True):
        if fitted is not None and plane is not None:
            plane.copy_(fitted if scale is None else torch.full_like(fitted, scale))
    impl = be.impl()
    counter = quant.ClipCounter()
    counter.watch("layer", impl)
    out = impl.forward(q, k, v, cache, be.metadata_builder().build(batch))
    exact = attnhub.PagedKVCache.allocate(num_blocks, BS, HKV, D, torch.float32)
    exact_spec = dataclasses.replace(spec, kv_cache_dtype="auto", dtype=torch.float32)
    reference.write_kv(exact, k.float(), v.float(), batch.slot_mapping)
    want, _ = reference.paged_attention(q.float(), exact, batch, exact_spec)
    err, cos = accuracy(out, want)
    return err, cos, counter.counts()["layer"]


def main() -> None:
    rows = [
        ("iluvatar", "int8", [None, 0.03, 0.02, 0.01], 127),
        ("torch", "fp8_e4m3", [None, 2 / 448, 1 / 448, 0.5 / 448], 448),
    ]
    print("| backend | cache | static scale | covers | max abs error | min cosine | clipped |")
    print("|---|---|---|---|---|---|---|")
    for backend, kv, scales, limit in rows:
        for scale in scales:
            err, cos, c = measure(backend, kv, scale)
            what = "calibrated" if scale is None else f"{scale:.3g}"
            covers = "the samples" if scale is None else f"abs(x) <= {scale * limit:.2f}"
            print(
                f"| {backend} | {kv} | {what} | {covers} | {err:.3f} | {cos:.5f} | "
                f"{100 * c.fraction:.2f}% |"
            )


if __name__ == "__main__":
    main()
