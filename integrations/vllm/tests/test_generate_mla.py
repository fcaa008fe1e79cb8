"""End to end, MLA: a real vLLM engine runs a tiny DeepSeek-V2 (random weights, written locally
by ``vllm_generate.write_tiny_deepseek_v2``) through vLLM's own CPU MLA backend and through
attnhub's MLA backend for vLLM (``attnhub_vllm.mla``: the decode through attnhub's absorbed
form over vLLM's own latent cache plane, the prefill through the same attnhub backend's
standard impl in the expanded form where it serves the layer's 96 / 32 geometry, else vLLM's
own ``forward_mha``: ``attnhub_vllm.mla_prefill``).

vLLM's own run (float32 and bfloat16):
- completes with the backend vLLM selects on this CPU (``CPU_MLA``; ``AMX_MLA`` with AMX), as
  ``attnhub_cpu.mla_ops`` says vLLM selects it, in every attention layer;
- greedy tokens and logprobs are produced for every prompt;
- the KV cache vLLM allocates per layer is [num_blocks, block_size, 576] of the model dtype,
  i.e. exactly the bytes of attnhub's ``LatentKVCache`` joint layout for the same ``MLASpec``;
- the engine process imported the same ``attnhub`` as this one (PYTHONPATH reaches it).

attnhub's runs (``torch`` in float32 and bfloat16, ``cpu`` in float32: vLLM's
``mla_decode_kvcache``, decode only, block 16; every other installed backend that declares MLA
in bfloat16, emulated), against vLLM's ``CPU_MLA`` at block 16:
- every MLA layer runs attnhub's backend class, through the attnhub backend asked for;
- the same greedy tokens under the project's criterion (``test_generate``: identical in
  float32; in bfloat16 identical up to a near-tie, logprobs within ``BF16_LOGPROB_TOL``);
- the KV bytes per layer equal vLLM's, and the adapter measured 0 bytes beside them;
- who served the prefill, as the adapter logs it: attnhub for ``torch``, vLLM's own with the
  backend's reason elsewhere (``cpu``: one head size for keys and values).

A backend that declares no MLA is refused at engine start with its reason (vLLM errors; it
does not fall back to its own MLA backend).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from attnhub.mla import LatentKVCache, MLASpec

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    from test_generate import _compare_bf16, _run_script, vllm_refusal
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
        args += ["--block-size", str(block), "--max-tokens", str(MAX_TOKENS), "--vary-max-tokens"]
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
    assert [len(t) for t in ids] == [MAX_TOKENS + i % 4 for i in range(len(ids))], ids
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


# --- attnhub serving the MLA layers ---------------------------------------------------------

_ATTNHUB_RUNS: dict[tuple[str, str], dict] = {}


def _other_mla_backends() -> list[str]:
    """Installed attnhub backends besides ``torch`` and ``cpu`` that declare MLA (the vendor
    ones run emulated): each gets a bfloat16 run too."""
    import attnhub

    return sorted(
        info.name
        for info in attnhub.list_backends()
        if info.backend is not None
        and info.name not in ("torch", "cpu")
        and info.backend.capabilities.mla.dtypes
    )


#: (attnhub backend, dtype) runs against vLLM's CPU_MLA at block 16 (vLLM's CPU platform forces
#: block 16 for MLA models unless AMX_MLA is picked).
ATTNHUB_RUNS = [("torch", "float32"), ("torch", "bfloat16"), ("cpu", "float32")] + [
    (name, "bfloat16") for name in _other_mla_backends()
]


def _mla_refusal(attention: str, dtype: str) -> str | None:
    """Why attnhub's backend ``attention`` cannot serve the tiny model's MLA layers (block 16)
    here, or None (vendor backends: through their emulators)."""
    import attnhub
    from attnhub.errors import AttnhubError

    try:
        cls = attnhub.get_backend(attention)
    except AttnhubError as exc:
        return f"the {attention} backend is not installed: {exc}"
    why = cls.availability("cpu", emulate=attention not in ("torch", "cpu"))
    if why is not None:
        return why
    reasons = [str(r) for r in cls.unsupported_reasons(spec_for(DTYPES[dtype], 16))]
    if cls.capabilities.mla.dtypes:  # the adapter's own condition (vLLM's joint plane)
        from attnhub_vllm.mapping import mla_layout_refusal

        layout = mla_layout_refusal(attention, tuple(cls.capabilities.mla.layouts))
        reasons += [] if layout is None else [layout]
    return "; ".join(reasons) or None


def attnhub_run(model: str, attention: str, dtype: str, tmp: Path) -> dict:
    """One engine run through attnhub's MLA backend (cached): block 16, as vLLM's run."""
    why = _mla_refusal(attention, dtype)
    if why is not None:
        pytest.skip(f"attnhub's {attention} backend cannot serve this MLA model here: {why}")
    key = (attention, dtype)
    if key not in _ATTNHUB_RUNS:
        out = tmp / f"mla-{attention}-{dtype}.json"
        args = ["--attention", attention, "--model", model, "--dtype", dtype]
        args += ["--block-size", "16", "--max-tokens", str(MAX_TOKENS), "--vary-max-tokens"]
        proc = _run_script(*args, "--out", str(out))
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-6000:]
        _ATTNHUB_RUNS[key] = json.loads(out.read_text()) | {"log": log}
    return _ATTNHUB_RUNS[key]


def vllm_cpu_mla_run(model: str, dtype: str, tmp: Path) -> dict:
    """vLLM's own run with ``CPU_MLA`` (block 16): what attnhub's runs are compared with."""
    result, backend, _ = run(model, dtype, tmp)
    if backend != "CPU_MLA":
        pytest.skip(f"vLLM picks {backend} on this CPU (block 32); attnhub's runs are at block 16")
    return result


@pytest.mark.parametrize(("attention", "dtype"), ATTNHUB_RUNS)
def test_attnhub_serves_the_mla_layers_with_vllms_tokens(
    model_dir: str, tmp_path: Path, attention: str, dtype: str
) -> None:
    ref = vllm_cpu_mla_run(model_dir, dtype, tmp_path)
    got = attnhub_run(model_dir, attention, dtype, tmp_path)
    classes = {lay["backend_class"] for lay in got["attention_layers"]}
    assert classes == {"attnhub_vllm.mla.AttnhubVllmMLABackend"}, got["attention_layers"]
    served = got["attnhub_backends"]
    assert len(served) == 1 and f"'{attention}'" in served[0], served
    if attention not in ("torch", "cpu"):  # vendor backends run through their CPU emulators
        assert "emulated" in served[0], served
    # the same batches: decodes first, the same requests' query lengths in every step
    assert [s["query_lens"] for s in got["steps"]] == [s["query_lens"] for s in ref["steps"]]
    mixed = [s for s in ref["steps"] if 1 in s["query_lens"] and max(s["query_lens"]) > 1]
    assert mixed, "no step mixed decodes (forward_mqa) and prefills (forward_mha)"
    n = len(ref["token_ids"])
    if dtype == "float32":
        assert got["token_ids"] == ref["token_ids"]
        print(f"\nMLA {attention} fp32: {n}/{n} prompts identical; {len(mixed)} mixed steps")
    else:
        notes = _compare_bf16(ref, got)
        same = sum(a == b for a, b in zip(ref["token_ids"], got["token_ids"], strict=True))
        print(f"\nMLA {attention} bf16: {same}/{n} prompts identical; " + "; ".join(notes))


@pytest.mark.parametrize(("attention", "dtype"), ATTNHUB_RUNS)
def test_attnhub_mla_works_in_vllms_latent_cache_with_no_extra_bytes(
    model_dir: str, tmp_path: Path, attention: str, dtype: str
) -> None:
    ref = vllm_cpu_mla_run(model_dir, dtype, tmp_path)
    got = attnhub_run(model_dir, attention, dtype, tmp_path)
    # vLLM allocates the same per-layer tensor whoever serves the layer ...
    shapes = [(lay["kv_cache_shape"], lay["bytes"]) for lay in got["attention_layers"]]
    assert shapes == [(lay["kv_cache_shape"], lay["bytes"]) for lay in ref["attention_layers"]]
    # ... and attnhub's latent cache is a view of it: the adapter measured nothing beside it
    found = re.search(
        rf"backend '{attention}' MLA KV cache per layer: (\d+) bytes in vLLM's tensor, "
        r"(\d+) bytes extra",
        got["log"],
    )
    assert found, got["log"][-3000:]
    assert int(found[1]) == ref["attention_layers"][0]["bytes"]
    assert int(found[2]) == 0


def _prefill_route(attention: str, dtype: str) -> Any:
    """The adapter's decision for the tiny model's prefill on backend ``attention``
    (``mla_prefill.prefill_route``, as the impl takes it at construction)."""
    from attnhub_vllm.mla_prefill import prefill_route

    import attnhub

    emulate = attention not in ("torch", "cpu")
    spec = spec_for(DTYPES[dtype], 16)
    backend = attnhub.select_backend(spec, "cpu", prefer=attention, emulate=emulate)
    return prefill_route(backend, spec, "cpu", emulate)


@pytest.mark.parametrize(("attention", "dtype"), ATTNHUB_RUNS)
def test_the_adapter_logs_who_served_the_mla_prefill(
    model_dir: str, tmp_path: Path, attention: str, dtype: str
) -> None:
    """Every run's prefill path is logged once, at engine start (never a silent path): attnhub's
    expanded form (``torch``: keys 96, values 32) or vLLM's own ``forward_mha`` with the
    backend's reason (``cpu``: one head size for keys and values); and the run's tokens are
    vLLM's (``test_attnhub_serves_the_mla_layers_with_vllms_tokens``) either way."""
    vllm_cpu_mla_run(model_dir, dtype, tmp_path)  # CPU_MLA's engine: no cached context
    got = attnhub_run(model_dir, attention, dtype, tmp_path)
    found = re.findall(
        rf"backend '{attention}' MLA prefill \(forward_mha\): (attnhub|vLLM's own)([^\n]*)",
        got["log"],
    )
    assert found, got["log"][-3000:]
    assert len(set(found)) == 1, found  # one decision for the model's layers
    served, detail = found[0]
    route = _prefill_route(attention, dtype)
    assert served == ("attnhub" if route.backend is not None else "vLLM's own"), found
    if attention == "torch":
        assert served == "attnhub", found
        assert "head_size 96, head_size_v 32" in detail, detail
    if attention == "cpu":
        assert served == "vLLM's own", found
        assert "vLLM's CPU kernels take one head_dim for query, key and value" in got["log"]
    print(f"\nMLA {attention} {dtype}: prefill {served}{detail[:120]}")


def _backend_without_mla() -> tuple[str, str] | None:
    """An installed attnhub backend that declares no MLA (``Capabilities.mla.dtypes`` empty)
    and its reason, or None."""
    import attnhub

    for info in attnhub.list_backends():
        cls = info.backend
        if cls is None or cls.capabilities.mla.dtypes:
            continue
        reasons = cls.unsupported_reasons(spec_for(torch.float32, 16))
        return cls.name, str(reasons[0])
    return None


def test_backend_without_mla_is_refused_at_engine_start(model_dir: str, tmp_path: Path) -> None:
    """vLLM does not fall back to its own MLA backend: engine start fails with the adapter's
    refusal and the backend's reason."""
    found = _backend_without_mla()
    if found is None:
        pytest.skip("every installed attnhub backend declares MLA")
    name, reason = found
    out = tmp_path / "refused.json"
    args = ["--attention", name, "--model", model_dir, "--dtype", "float32", "--block-size", "16"]
    proc = _run_script(*args, "--out", str(out))
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not out.exists(), log[-3000:]
    assert "AttnhubConfigurationError" in log, log[-3000:]
    assert f"attnhub backend {name} cannot serve this vLLM MLA layer" in log, log[-3000:]
    assert reason in log, log[-3000:]
