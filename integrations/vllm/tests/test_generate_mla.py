"""End to end, MLA: a real vLLM engine runs a tiny DeepSeek-V2 (random weights, written locally
by ``vllm_generate.write_tiny_deepseek_v2``) through vLLM's own CPU MLA backend, in float32 and
bfloat16. attnhub does not serve MLA through vLLM yet, so what is checked is the ground the
attnhub run will stand on:

- the run completes with the backend vLLM selects on this CPU (``CPU_MLA``; ``AMX_MLA`` with
  AMX), as ``attnhub_cpu.mla_ops`` says vLLM selects it, in every attention layer;
- greedy tokens and logprobs are produced for every prompt;
- the KV cache vLLM allocates per layer is [num_blocks, block_size, 576] of the model dtype,
  i.e. exactly the bytes of attnhub's ``LatentKVCache`` joint layout for the same ``MLASpec``
  (no extra bytes per block: the plane can be viewed as attnhub's cache without a copy);
- the engine process imported the same ``attnhub`` as this one (PYTHONPATH reaches it).
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from attnhub.mla import LatentKVCache, MLASpec

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    from test_generate import _run_script, vllm_refusal
finally:
    sys.path.remove(str(HERE))

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (nox -s vllm)"
)

MAX_TOKENS = 8
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    sys.path.insert(0, str(HERE))
    try:
        from vllm_generate import write_tiny_deepseek_v2
    finally:
        sys.path.remove(str(HERE))
    return write_tiny_deepseek_v2(str(tmp_path_factory.mktemp("tiny-deepseek-v2")))


def spec_for(dtype: torch.dtype, block_size: int) -> MLASpec:
    """The tiny model's MLA layer as attnhub describes it."""
    cfg = dict(num_heads=4, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32)
    return MLASpec(**cfg, v_head_dim=32, dtype=dtype, block_size=block_size)


_RUNS: dict[str, dict] = {}


def run(model: str, dtype: str, tmp: Path) -> tuple[dict, str, MLASpec]:
    """One engine run per dtype (cached): the result, the backend vLLM should name, the spec."""
    mla_ops = pytest.importorskip("attnhub_cpu.mla_ops")
    from attnhub_cpu import ops

    features = ops.detect()
    backend = mla_ops.vllm_mla_backend(features)
    block = 16 if backend == "CPU_MLA" else 32
    spec = spec_for(DTYPES[dtype], block)
    refusals = mla_ops.vllm_mla_refusals(features, spec)
    if refusals:
        pytest.skip(f"vLLM's {backend} refuses this on this CPU: {'; '.join(refusals)}")
    if dtype not in _RUNS:
        out = tmp / f"mla-{dtype}.json"
        args = ["--attention", "vllm", "--model", model, "--dtype", dtype]
        args += ["--block-size", str(block), "--max-tokens", str(MAX_TOKENS)]
        proc = _run_script(*args, "--out", str(out))
        log = proc.stdout + proc.stderr
        if proc.returncode:
            refusal = vllm_refusal(log)
            if refusal is not None:
                pytest.skip(f"vLLM refused on this machine: {refusal}")
        assert proc.returncode == 0, log[-6000:]
        _RUNS[dtype] = json.loads(out.read_text()) | {"log": log}
    return _RUNS[dtype], backend, spec


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_vllm_runs_the_tiny_deepseek_with_its_cpu_mla_backend(
    model_dir: str, tmp_path: Path, dtype: str
) -> None:
    result, backend, _ = run(model_dir, dtype, tmp_path)
    assert result["mla"] is True
    layers = result["attention_layers"]
    assert [lay["backend"] for lay in layers] == [backend, backend], layers
    ids = result["token_ids"]
    assert ids and all(len(t) == MAX_TOKENS for t in ids), ids
    assert all(0 <= t < 1000 for seq in ids for t in seq)
    for seq, lps in zip(ids, result["logprobs"], strict=True):
        assert len(lps) == len(seq)
        for token, step in zip(seq, lps, strict=True):
            # the chosen token's logprob is recorded, finite, and the greedy choice is the best
            assert str(token) in {str(k) for k in step}
            values = {int(k): v for k, v in step.items()}
            assert math.isfinite(values[token])
            assert values[token] == max(values.values())


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_vllm_latent_cache_is_attnhubs_joint_layout_with_no_extra_bytes(
    model_dir: str, tmp_path: Path, dtype: str
) -> None:
    result, _, spec = run(model_dir, dtype, tmp_path)
    one_block = LatentKVCache.for_spec(spec, 1)
    joint_bytes = one_block.joint.numel() * one_block.joint.element_size()
    assert joint_bytes == spec.block_size * 576 * DTYPES[dtype].itemsize
    for lay in result["attention_layers"]:
        num_blocks = lay["kv_cache_shape"][0]
        assert lay["kv_cache_shape"] == [num_blocks, spec.block_size, spec.latent_size], lay
        assert lay["kv_cache_dtype"] == dtype, lay
        assert lay["bytes"] == num_blocks * joint_bytes, lay


def test_engine_process_imports_this_attnhub(model_dir: str, tmp_path: Path) -> None:
    import attnhub

    result, _, _ = run(model_dir, "float32", tmp_path)
    assert result["attnhub_file"] == attnhub.__file__
