"""The amx path on any CPU: vLLM's AMX tile layout of a block, and the backend run as it runs
on a CPU with AMX (the CPU's features injected, ``amx_backend``).

What runs for real everywhere vLLM's ``_C`` build loads (x86 with AVX512-BF16, AMX or not): the
amx KV write (``cpu_attn_reshape_and_cache`` on "amx" is plain stores), so the packed cache,
its readback and vLLM's page bytes are checked on the op itself. The amx attention needs AMX
tiles: on a CPU with AMX the real op runs; elsewhere a stand-in (``AmxAttentionStandIn``)
unpacks the very blocks the step reads and runs vLLM's vec kernel over them, so the backend's
plumbing (packed cache, block table, scheduler plan) is checked, not AMX's arithmetic.
Where the loaded build has no amx path (AVX2, AVX-512 without BF16), the backend refuses the
injected AMX spec with its reason: tested here too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from amx_standin import AmxAttentionStandIn, AmxCpuBackend
from attnhub_cpu import CpuBackend, layouts, ops
from attnhub_cpu.backend import is_kernel_storage

import attnhub
from attnhub import PagedKVCache, testing
from attnhub.errors import InvalidInputError, UnsupportedConfigurationError

HERE = Path(__file__).resolve().parent


def spec(**changes: object) -> attnhub.AttentionSpec:
    fields: dict[str, object] = dict(
        num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, block_size=32
    )
    fields.update(changes)
    return attnhub.AttentionSpec(**fields)  # type: ignore[arg-type]


# --- the packing, as pure tensor permutations (no kernels) ----------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packing_round_trips_and_puts_each_element_where_the_tiles_want_it(
    dtype: torch.dtype,
) -> None:
    b, h, n, d = 3, 2, 32, 64
    logical = torch.arange(b * h * n * d, dtype=torch.float32).reshape(b, h, n, d).to(dtype)
    p = 4 // logical.element_size()  # elements per 4-byte tile column
    for which in ("key", "value"):
        packed = torch.empty_like(logical)
        layouts.AMX_PACKING.pack(logical, which, packed)
        assert torch.equal(layouts.AMX_PACKING.unpack(packed, which), logical)
        flat = packed.reshape(b, h, n * d)
        token, channel = 21, 37  # one element, placed by the module docstring's formulas
        if which == "key":  # [n/16, d/p, 16, p]
            at = (token // 16) * 16 * d + (channel // p) * 16 * p + (token % 16) * p + channel % p
        else:  # [d/16, n/p, 16, p]
            at = (channel // 16) * n * 16 + (token // p) * 16 * p + (channel % 16) * p + token % p
        assert torch.equal(flat[1, 1, at], logical[1, 1, token, channel])


def test_a_packed_cache_is_read_through_unpacked_and_written_through_edit() -> None:
    logical = torch.randn(2, 2, 32, 64).to(torch.bfloat16)
    key, value = torch.empty_like(logical), torch.empty_like(logical)
    layouts.AMX_PACKING.pack(logical, "key", key)
    layouts.AMX_PACKING.pack(logical, "value", value)
    cache = PagedKVCache(key, value, 32, "HND", packing=layouts.AMX_PACKING)
    assert torch.equal(cache.unpacked().key, logical)
    with pytest.raises(InvalidInputError, match=r"packed \(amx\).*cache.unpacked\(\)"):
        cache.key_nhd()
    with cache.edit() as plain:
        plain.value[1, 0, 5] = 7
    assert (cache.unpacked().value[1, 0, 5] == 7).all()
    assert torch.equal(cache.unpacked().key, logical)  # the rest as it was
    with pytest.raises(InvalidInputError, match="HND"):
        PagedKVCache(key, value, 32, "NHD", packing=layouts.AMX_PACKING)


# --- the backend as on an AMX CPU -----------------------------------------------------------


def amx_backend(s: attnhub.AttentionSpec) -> CpuBackend:
    """The cpu backend as it is on a CPU with AMX (its features injected); its attention
    through ``AmxAttentionStandIn`` where this CPU has no AMX tiles. Skips where the kernels
    cannot load or the loaded build has no amx path."""
    why = ops.unavailable_reason()
    if why is not None:
        pytest.skip(f"vLLM's CPU kernels are not usable here: {why}")
    try:
        return AmxCpuBackend(s)
    except UnsupportedConfigurationError as exc:  # this build has no amx path
        assert ops.layout_written("amx", s.dtype, s.block_size, s.head_size) is None
        pytest.skip(f"the loaded vLLM build ({ops.detect().library}) has no amx path: {exc}")


def step(backend: CpuBackend, seed: str) -> tuple[Any, ...]:
    """A decode over 40 cached tokens, a 5-token chunk after 20, a 7-token prefill, 2 padding
    rows; the cache filled through its packing (stale 1e3 where no sequence reaches)."""
    s = backend.spec
    g = testing.generator(testing.seed_of(seed))
    batch, num_blocks = testing.make_batch(
        [1, 5, 7], [41, 25, 7], s.block_size, seed=g, num_tokens=15
    )
    cache = backend.allocate_kv_cache(num_blocks)
    testing.fill_cache_random(cache, g)
    testing.poison_unused_slots(cache, batch)
    with cache.edit() as plain:  # finite stale data: the kernels compute on whole blocks
        plain.key.nan_to_num_(nan=1e3)
        plain.value.nan_to_num_(nan=1e3)
    q, k, v = testing.random_qkv(s, batch.num_tokens, g)
    return batch, cache, q, k, v


def test_on_amx_bf16_runs_vllms_amx_path_in_a_packed_cache() -> None:
    s = spec()
    backend = amx_backend(s)
    assert backend.isa == "amx" and backend.kv_packing == layouts.AMX_PACKING
    batch, cache, q, k, v = step(backend, "amx-mixed")
    assert cache.packing == layouts.AMX_PACKING and is_kernel_storage(cache, backend.kv_packing)
    expected_cache, expected = testing.reference_after_write(s, cache, batch, q, k, v)
    out = backend.impl().forward(q, k, v, cache, backend.metadata_builder().build(batch))
    n = batch.num_actual_tokens
    testing.assert_within(out[:n], expected, backend.capabilities.tolerance(s.dtype), batch=batch)
    # the KV write was vLLM's amx op's own: its bytes, read back through the packing
    assert testing.cache_differences(cache, expected_cache, batch.slot_mapping) == []
    if isinstance(backend.ops, AmxAttentionStandIn):
        assert backend.ops.calls == [
            "get_scheduler_metadata:amx",
            "cpu_attention_with_kv_cache:amx",
        ]


@pytest.mark.parametrize(
    ("changes", "isa"),
    [
        (dict(dtype=torch.float16), "vec"),
        (dict(block_size=16), "vec16"),
        (dict(head_size=80), "vec16"),
    ],
)
def test_on_amx_what_vllm_runs_off_amx_is_not_packed(changes: dict, isa: str) -> None:
    backend = amx_backend(spec(**changes))
    assert backend.isa == isa and backend.kv_packing is None
    assert backend.allocate_kv_cache(2).packing is None


def test_a_plain_cache_gives_the_packed_caches_bits_on_amx() -> None:
    """A cache in other strides (K|V side by side, not packed) is written by indexing and
    packed into scratch kernel storage per layer: the same output and the same K/V."""
    s = spec()
    backend = amx_backend(s)
    batch, cache, q, k, v = step(backend, "amx-plain")
    logical = cache.unpacked()
    both = torch.empty((*logical.key.shape[:-1], 2 * s.head_size), dtype=s.dtype)
    plain = PagedKVCache(both[..., : s.head_size], both[..., s.head_size :], 32, "HND")
    plain.key.copy_(logical.key)
    plain.value.copy_(logical.value)
    meta = backend.metadata_builder().build(batch)
    impl = backend.impl()
    packed_out = impl.forward(q, k, v, cache, meta)
    plain_out = impl.forward(q, k, v, plain, meta)
    assert torch.equal(packed_out, plain_out)
    after = cache.unpacked()
    assert torch.equal(after.key, plain.key) and torch.equal(after.value, plain.value)


def test_a_cache_packed_otherwise_is_refused_before_any_write() -> None:
    backend = amx_backend(spec(dtype=torch.float16))  # vec: not packed
    cache = amx_backend(spec()).allocate_kv_cache(2)  # amx-packed, bf16
    cache = PagedKVCache(
        cache.key.half(), cache.value.half(), 32, "HND", packing=layouts.AMX_PACKING
    )
    before = cache.clone()
    k = torch.ones(1, 2, 64, dtype=torch.float16)
    with pytest.raises(
        InvalidInputError, match="packed amx, this backend's kernels' blocks are not"
    ):
        backend.impl().write_kv(k, k, cache, torch.tensor([3]))
    assert cache.equal(before)


def test_in_vllms_pages_the_amx_bytes_are_vllms_own() -> None:
    """kv_cache_from_pages on amx: the packed blocks inside vLLM's LBHNC tensor ([B, H, 2N, D],
    keys then values), written by the backend exactly as vLLM's own amx write leaves them, and
    read back through the packing."""
    s = spec()
    backend = amx_backend(s)
    kv = torch.zeros(4, 2, 32, 128, dtype=s.dtype)  # vLLM's per-layer tensor
    pages = kv.view(4, -1)
    cache = backend.kv_cache_from_pages(pages)
    assert cache.packing == layouts.AMX_PACKING and is_kernel_storage(cache, backend.kv_packing)
    g = testing.generator(3)
    k, v = (torch.randn(5, 2, 64, generator=g).to(s.dtype) for _ in range(2))
    slots = torch.tensor([3, 40, -1, 97, 127])
    backend.impl().write_kv(k, v, cache, slots)
    theirs = torch.zeros(4, 2, 64, 64, dtype=s.dtype)  # vLLM's view: [B, H, 2N, D], chunked
    k_cache, v_cache = theirs.chunk(2, dim=2)
    ops.kernels().cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, slots, "amx", 1.0, 1.0, "auto")
    assert torch.equal(kv.view(-1), theirs.view(-1))
    logical = cache.unpacked()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(logical.key[slot // 32, :, slot % 32], k[t])
            assert torch.equal(logical.value[slot // 32, :, slot % 32], v[t])


def test_a_path_whose_write_attnhub_does_not_recognize_is_refused_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Never a silent other path: where vLLM's pick writes blocks in a layout other than the
    one attnhub reads for it, the backend refuses, naming vLLM's path and the layout found."""
    if ops.unavailable_reason() is not None:
        pytest.skip(f"vLLM's CPU kernels are not usable here: {ops.unavailable_reason()}")
    monkeypatch.setattr(ops, "layout_written", lambda *args: layouts.TRANSPOSED)
    cls = AmxCpuBackend
    with pytest.raises(UnsupportedConfigurationError, match=r"'amx' path.*transposed one"):
        cls(spec())
    monkeypatch.setattr(ops, "layout_written", lambda *args: None)
    with pytest.raises(UnsupportedConfigurationError, match="a layout attnhub does not know"):
        cls(spec())


def test_the_conformance_suite_passes_on_the_amx_path(tmp_path: Path) -> None:
    """The whole suite (quick scope) on ``cpu-amx``: every case on vLLM's amx path, the cache
    AMX-packed, its writes vLLM's own amx op, checked through ``unpacked()`` (on a CPU without
    AMX, the attention through the stand-in)."""
    amx_backend(spec())  # skips, with the reason, where the amx path cannot run here
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    )
    env.pop("ATTNHUB_BACKEND", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "pytest", "-p", "amx_suite_plugin", "--pyargs"]
    cmd += ["attnhub_conformance", "-q", "-p", "no:cacheprovider", "--attnhub-backend=cpu-amx"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"\b[1-9]\d* passed", out) and " failed" not in out, out[-2000:]
