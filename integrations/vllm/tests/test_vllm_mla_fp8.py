"""fp8 latent caches through the adapter's MLA layers (vLLM ``kv_cache_dtype`` fp8 / fp8_e4m3 /
fp8_e5m2 -> attnhub's fp8 latents with the layer's one ``_k_scale``; docs/mla.md, "In vLLM").

vLLM's CPU build has no ``concat_and_cache_mla`` (neither ``torch.ops._C`` nor
``torch.ops._C_cache_ops`` registers it: ``test_vllms_cpu_build_has_no_concat_and_cache_mla``),
so the adapter's write is compared with the conformance suite's model of that kernel's bytes
(``attnhub_conformance.mla_fp8.encode``: the fp8 conversion from the bit layout alone).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (nox -s vllm)"
)

R, P, HEADS, BLOCK = 512, 64, 4, 16  # the tiny DeepSeek-V2's latent (vllm_generate.py)


def _impl(kv_cache_dtype: str, backend: str = "torch", dtype: str = "bfloat16") -> Any:
    """The adapter's MLA impl as vLLM's ``MLAAttention`` builds it for one layer of the tiny
    DeepSeek-V2 (``vllm_generate.mla_layer_impl``: no weights needed for the latent write and
    the decode)."""
    from vllm_generate import mla_layer_impl

    impl, config = mla_layer_impl(
        _model(),
        {"backend": backend},
        num_heads=HEADS,
        nope_v=(32, 32),
        dtype=dtype,
        block_size=BLOCK,
        kv_cache_dtype=kv_cache_dtype,
    )
    impl.vllm_config = config  # (the test's: the forward context of a write)
    return impl


def _model() -> str:
    from vllm_generate import tiny_deepseek_v2_once  # this directory: pytest's rootdir insertion

    return tiny_deepseek_v2_once()


def test_vllms_cpu_build_has_no_concat_and_cache_mla() -> None:
    """Why the write is compared with the conformance model, not vLLM's kernel: the CPU build
    registers no ``concat_and_cache_mla`` (``vllm/_custom_ops.py`` calls
    ``torch.ops._C_cache_ops.concat_and_cache_mla``). Fails, so that this test is revisited,
    once it does."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    for ns in ("_C", "_C_cache_ops"):
        assert not hasattr(getattr(torch.ops, ns), "concat_and_cache_mla"), ns


@pytest.mark.parametrize(
    ("vllm_dtype", "fmt"), [("fp8", "e4m3"), ("fp8_e4m3", "e4m3"), ("fp8_e5m2", "e5m2")]
)
def test_adapter_writes_vllms_fp8_latent_bytes(vllm_dtype: str, fmt: str) -> None:
    """``do_kv_cache_update`` into vLLM's uint8 plane with the layer's ``_k_scale``: every
    written slot holds the bytes of vLLM's ``concat_and_cache_mla`` (fp8(x / scale), kv_c then
    k_pe, saturated), every other byte untouched; -1 slots skipped."""
    from attnhub_conformance.mla_fp8 import FP8_FORMATS, edge_values, encode

    impl = _impl(vllm_dtype)
    assert impl.spec.kv_cache_dtype == f"fp8_{fmt}"
    assert not impl.supports_quant_query_input  # the decode query stays in the model dtype
    fp8 = FP8_FORMATS[f"fp8_{fmt}"]
    g = torch.Generator().manual_seed(3)
    scale = torch.tensor(0.4125, dtype=torch.float32)  # vLLM's per-layer _k_scale
    n = 7
    kv_c = (torch.randn((n, R), generator=g) * 40).to(torch.bfloat16)
    k_pe = (torch.randn((n, 1, P), generator=g) * 40).to(torch.bfloat16)
    edges = edge_values(fp8, float(scale)).to(torch.bfloat16)  # ties, saturation, subnormals
    kv_c[0, : min(R, edges.numel())] = edges[:R]
    plane = torch.randint(0, 256, (4, BLOCK, R + P), generator=g, dtype=torch.uint8)
    before = plane.clone()
    slots = torch.tensor([5, 17, -1, 40, 63, 0, 33])
    from vllm.forward_context import set_forward_context

    with set_forward_context(None, impl.vllm_config):  # a step with prefills: vLLM's slots
        impl.do_kv_cache_update(kv_c, k_pe, plane, slots, vllm_dtype, scale)
    want = before.view(-1, R + P).clone()
    rows = encode(torch.cat([kv_c.float(), k_pe.reshape(n, P).float()], dim=1), float(scale), fp8)
    keep = slots >= 0
    want[slots[keep]] = rows[keep]
    assert torch.equal(plane.view(-1, R + P), want)


def test_backend_without_fp8_latents_is_refused_at_engine_start() -> None:
    """A backend whose ``Capabilities.mla.kv_cache_dtypes`` lacks fp8 (``cpu``: vLLM's
    ``mla_decode_kvcache`` reads the model dtype only) refuses the layer at construction
    (engine start), naming the format."""
    from attnhub_vllm.mapping import AttnhubConfigurationError

    import attnhub

    assert "fp8_e4m3" not in attnhub.get_backend("cpu").capabilities.mla.kv_cache_dtypes
    with pytest.raises(AttnhubConfigurationError, match="fp8_e4m3"):
        _impl("fp8", backend="cpu")


def _engine(attention: str, kv_cache_dtype: str, tmp: Any, *extra: str) -> dict:
    """One tiny-DeepSeek-V2 engine run (bfloat16, block 16: vLLM's CPU MLA block) in a process
    of its own, through attnhub's MLA backend for vLLM."""
    import json
    import sys
    from pathlib import Path

    here = str(Path(__file__).resolve().parent)
    sys.path.insert(0, here)
    try:
        from test_generate import _run_script
    finally:
        sys.path.remove(here)
    out = Path(tmp) / f"mla-{attention}-{kv_cache_dtype}.json"
    args = ["--attention", attention, "--model", _model(), "--dtype", "bfloat16"]
    args += ["--block-size", "16", "--max-tokens", "8", "--vary-max-tokens"]
    proc = _run_script(*args, *extra, "--kv-cache-dtype", kv_cache_dtype, "--out", str(out))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return json.loads(out.read_text()) | {"log": log}


def test_engine_runs_fp8_latents_through_attnhub_torch(tmp_path: Any) -> None:
    """vLLM's CPU platform lets an MLA model run with ``kv_cache_dtype="fp8"`` once the MLA
    backend declares it (vLLM's own CPU_MLA declares "auto" only, so vLLM alone refuses it;
    attnhub's MLA backend for vLLM is registered in its place): an engine through attnhub
    ``torch`` with e4m3 latents in vLLM's uint8 cache (half the bf16 bytes, 0 extra), against
    the bf16-cache run of the same engine under the project's fp8 criterion
    (``test_generate``: the mean logprob error of the first step that reads the prompt from
    the cache within ``FP8_MEAN_LOGPROB_BOUND``, and above 0.005 nats: fp8 really in use; for
    MLA on CPU that is the first decode step, below)."""
    import re
    import sys
    from pathlib import Path

    here = str(Path(__file__).resolve().parent)
    sys.path.insert(0, here)
    try:
        from test_generate import EVERY_TOKEN, FP8_MEAN_LOGPROB_BOUND, first_step_errors
    finally:
        sys.path.remove(here)
    ref = _engine("torch", "auto", tmp_path)
    got = _engine("torch", "fp8", tmp_path, "--logprobs", str(EVERY_TOKEN))
    layers, ref_layer = got["attention_layers"], ref["attention_layers"][0]
    assert {lay["backend_class"] for lay in layers} == {"attnhub_vllm.mla.AttnhubVllmMLABackend"}
    assert {lay["kv_cache_dtype"] for lay in layers} == {"uint8"}, layers
    assert ref_layer["kv_cache_dtype"] == "bfloat16"
    per_block = layers[0]["bytes"] / layers[0]["kv_cache_shape"][0]
    assert 2 * per_block == ref_layer["bytes"] / ref_layer["kv_cache_shape"][0]
    found = re.search(r"MLA KV cache per layer: (\d+) bytes in vLLM's tensor, (\d+) bytes extra",
                      got["log"])  # fmt: skip
    assert found and int(found[2]) == 0, got["log"][-3000:]
    # vLLM's MLA prefill attends over the step's own latents (forward_mha, not the cache: no
    # context on CPU), so the first step is the bf16 run's exactly; the second (the first
    # decode, after the same first token) reads the whole prompt back from the fp8 cache
    assert first_step_errors(ref, got) == [0.0] * len(ref["token_ids"])
    second = {
        "token_ids": [t[1:] for t in ref["token_ids"]],
        "logprobs": [lp[1:] for lp in ref["logprobs"]],
    }
    assert all(a[0] == b[0] for a, b in zip(ref["token_ids"], got["token_ids"], strict=True))
    errors = first_step_errors(second, {"logprobs": [lp[1:] for lp in got["logprobs"]]})
    mean = sum(errors) / len(errors)
    same = sum(a == b for a, b in zip(ref["token_ids"], got["token_ids"], strict=True))
    print(
        f"\nMLA fp8 latents (attnhub torch): mean first-decode logprob error vs the bf16 cache "
        f"{mean:.4f} nats (bound {FP8_MEAN_LOGPROB_BOUND}); prompts identical {same}/{len(errors)}"
    )
    assert mean > 0.005, "the fp8 run matches the bf16 cache: fp8 is not in use"
    assert mean <= FP8_MEAN_LOGPROB_BOUND
