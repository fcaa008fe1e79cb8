"""End to end, MLA: a real vLLM engine runs tiny DeepSeek-V2s (random weights, written locally
by ``vllm_generate.write_tiny_deepseek_v2``: "h4", 4 heads with qk_nope / v head 32; "h32",
DeepSeek's per-head geometry, qk_nope 128 / rope 64 / v 128, at 32 heads) through vLLM's own CPU
MLA backend and through attnhub's MLA backend for vLLM (``attnhub_vllm.mla``: the decode through
attnhub's absorbed form in vLLM's own latent cache tensor, the prefill through the same attnhub
backend's standard impl in the expanded form where it serves the layer's geometry, else vLLM's
own ``forward_mha``: ``attnhub_vllm.mla_prefill``).

vLLM's own run (h4 float32 and bfloat16, h32 bfloat16):
- completes with the backend vLLM selects on this CPU (``CPU_MLA``; ``AMX_MLA`` with AMX), as
  ``attnhub_cpu.mla_ops`` says vLLM selects it, in every attention layer;
- greedy tokens and logprobs are produced for every prompt;
- the KV cache vLLM allocates per layer is [num_blocks, block_size, 576] of the model dtype,
  i.e. exactly the bytes of attnhub's ``LatentKVCache`` joint layout for the same ``MLASpec``;
- the engine process imported the same ``attnhub`` as this one (PYTHONPATH reaches it).

attnhub's runs, parametrized by (backend, flash provider, dtype, model) (``torch`` h4 float32
and bfloat16 and h32 bfloat16; ``cpu`` h4 float32: vLLM's ``mla_decode_kvcache``, decode only,
block 16; emulated on h32 in bfloat16: ``ascend``, ``flash`` with ``vllm-fa3`` and
``vllm-flashmla``, and any other installed backend that declares MLA), against vLLM's
``CPU_MLA`` at block 16:
- every MLA layer runs attnhub's backend class, through the attnhub backend (provider) asked for;
- the same greedy tokens under the project's criterion (``test_generate``: identical in
  float32; in bfloat16 identical up to a near-tie, logprobs within ``BF16_LOGPROB_TOL``);
- the KV bytes per layer equal vLLM's, and the adapter measured 0 bytes beside them, in the
  layout the backend reads (``ascend``: split planes carved in place);
- a run the engine's block size rules out (FlashMLA pages by 64; vLLM's CPU platform forces 16
  for MLA models without AMX) is skipped with vLLM's log line and the backend's refusal.
- who served the prefill, as the adapter logs it: attnhub where the backend serves the expanded
  geometry (``torch``; ``ascend`` and ``flash`` on h32), vLLM's own with the backend's reason
  elsewhere (``cpu``: one head size for keys and values).

The split-layout rule with a real ``VllmConfig``: kept where vLLM's CPU platform turned chunked
prefill and prefix caching off (a write lands where the split view says), refused at
construction where either is on. A backend that declares no MLA is refused at engine start
with its reason (vLLM errors; it does not fall back to its own MLA backend).
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

#: The tiny DeepSeek-V2s (``write_tiny_deepseek_v2``'s arguments): "h4", 4 heads with qk_nope /
#: v head 32 (the default); "h32", DeepSeek's own per-head geometry (qk_nope 128, rope 64, v
#: 128, kv_lora_rank 512) at 32 heads, a head count the vendor kernels take (FIA's MLA form:
#: query N 32, 64 or 128).
MODELS = {
    "h4": {"num_heads": 4, "qk_nope_head_dim": 32, "v_head_dim": 32},
    "h32": {"num_heads": 32, "qk_nope_head_dim": 128, "v_head_dim": 128},
}
_MODEL_DIRS: dict[str, str] = {}


def write_model(name: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model ``name`` of :data:`MODELS`, written once per session (random weights)."""
    if name not in _MODEL_DIRS:
        sys.path.insert(0, str(HERE))
        try:
            from vllm_generate import write_tiny_deepseek_v2
        finally:
            sys.path.remove(str(HERE))
        path = str(tmp_path_factory.mktemp(f"tiny-deepseek-v2-{name}"))
        _MODEL_DIRS[name] = write_tiny_deepseek_v2(path, **MODELS[name])
    return _MODEL_DIRS[name]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model("h4", tmp_path_factory)


def spec_for(dtype: torch.dtype, block_size: int, model: str = "h4") -> MLASpec:
    """The tiny model's MLA layer as attnhub describes it."""
    return MLASpec(
        **MODELS[model], kv_lora_rank=512, qk_rope_head_dim=64, dtype=dtype, block_size=block_size
    )


_RUNS: dict[tuple[str, str], dict] = {}


def run(model: str, dtype: str, tmp: Path, name: str = "h4") -> tuple[dict, str, MLASpec]:
    """vLLM's own engine run of model ``name`` (at ``model``) per dtype (cached): the result,
    the backend vLLM should name, the spec."""
    mla_ops = pytest.importorskip("attnhub_cpu.mla_ops")
    from attnhub_cpu import ops

    features = ops.detect()
    backend = mla_ops.vllm_mla_backend(features)
    block = 16 if backend == "CPU_MLA" else 32
    spec = spec_for(DTYPES[dtype], block, name)
    refusals = mla_ops.vllm_mla_refusals(features, spec)
    if refusals:
        pytest.skip(f"vLLM's {backend} refuses this on this CPU: {'; '.join(refusals)}")
    if (name, dtype) not in _RUNS:
        out = tmp / f"mla-{name}-{dtype}.json"
        args = ["--attention", "vllm", "--model", model, "--dtype", dtype]
        args += ["--block-size", str(block), "--max-tokens", str(MAX_TOKENS), "--vary-max-tokens"]
        proc = _run_script(*args, "--out", str(out))
        log = proc.stdout + proc.stderr
        if proc.returncode:
            refusal = vllm_refusal(log)
            if refusal is not None:
                pytest.skip(f"vLLM refused on this machine: {refusal}")
        assert proc.returncode == 0, log[-6000:]
        _RUNS[name, dtype] = json.loads(out.read_text()) | {"log": log}
    return _RUNS[name, dtype], backend, spec


#: vLLM's own runs: (model, dtype)
VLLM_RUNS = [("h4", "float32"), ("h4", "bfloat16"), ("h32", "bfloat16")]


@pytest.mark.parametrize(("model", "dtype"), VLLM_RUNS)
def test_vllm_runs_the_tiny_deepseek_with_its_cpu_mla_backend(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, model: str, dtype: str
) -> None:
    result, backend, _ = run(write_model(model, tmp_path_factory), dtype, tmp_path, model)
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


@pytest.mark.parametrize(("model", "dtype"), VLLM_RUNS)
def test_vllm_latent_cache_is_attnhubs_joint_layout_with_no_extra_bytes(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, model: str, dtype: str
) -> None:
    result, _, spec = run(write_model(model, tmp_path_factory), dtype, tmp_path, model)
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

_ATTNHUB_RUNS: dict[tuple[str, str | None, str, str], dict] = {}
#: runs vLLM's engine config ruled out, and why (the engine is not started twice)
_ENGINE_SKIPS: dict[tuple[str, str | None, str, str], str] = {}

#: The attnhub backends with runs of their own below; any other installed backend that
#: declares MLA gets a bfloat16 run on the 32-head model (emulated).
NAMED = ("torch", "cpu", "ascend", "flash")


def _other_mla_backends() -> list[str]:
    """Installed attnhub backends besides :data:`NAMED` that declare MLA (the vendor ones run
    emulated)."""
    import attnhub

    return sorted(
        info.name
        for info in attnhub.list_backends()
        if info.backend is not None
        and info.name not in NAMED
        and info.backend.capabilities.mla.dtypes
    )


def _run(attention: str, provider: str | None, dtype: str, model: str) -> Any:
    """One attnhub run's parameters, its id naming the provider where one is asked for."""
    name = attention if provider is None else f"{attention}[{provider}]"
    return pytest.param(attention, provider, dtype, model, id=f"{name}-{dtype}-{model}")


#: (attnhub backend, flash provider, dtype, model) runs against vLLM's CPU_MLA at block 16
#: (vLLM's CPU platform forces block 16 for MLA models unless AMX_MLA is picked): the vendor
#: backends on the 32-head model (DeepSeek's per-head geometry), in bfloat16, emulated;
#: ``flash`` through the providers that declare MLA (``ATTNHUB_FLASH_PROVIDER`` in the engine
#: process: the default provider in vLLM's environment, vLLM's fork's FA2, declares none).
ATTNHUB_RUNS = [
    _run("torch", None, "float32", "h4"),
    _run("torch", None, "bfloat16", "h4"),
    _run("cpu", None, "float32", "h4"),
    _run("torch", None, "bfloat16", "h32"),
    _run("ascend", None, "bfloat16", "h32"),
    _run("flash", "vllm-fa3", "bfloat16", "h32"),
    _run("flash", "vllm-flashmla", "bfloat16", "h32"),
] + [_run(name, None, "bfloat16", "h32") for name in _other_mla_backends()]

#: The block size a run asks vLLM for where it is not 16: FlashMLA pages by 64 only.
RUN_BLOCK = {"vllm-flashmla": 64}


def _backend_class(attention: str, provider: str | None) -> Any:
    import attnhub

    if provider is None:
        return attnhub.get_backend(attention)
    from attnhub_flash.backend import backend_class

    return backend_class(provider)


def _mla_refusal(
    attention: str, provider: str | None, dtype: str, model: str, block: int
) -> str | None:
    """Why attnhub's backend ``attention`` (with ``provider``) cannot serve the tiny model's
    MLA layers at ``block`` here, or None (vendor backends: through their emulators). The
    adapter's layout condition is the one of vLLM's CPU platform for MLA models (no chunked
    prefill, no prefix caching: no prefill has cached context), which the engine run checks
    for real."""
    from attnhub.errors import AttnhubError

    try:
        cls = _backend_class(attention, provider)
    except AttnhubError as exc:
        return f"the {attention} backend is not installed: {exc}"
    why = cls.availability("cpu", emulate=attention not in ("torch", "cpu"))
    if why is not None:
        return why
    reasons = [str(r) for r in cls.unsupported_reasons(spec_for(DTYPES[dtype], block, model))]
    if cls.capabilities.mla.dtypes:  # the adapter's own condition (vLLM's memory)
        from attnhub_vllm.mapping import mla_layout_refusal

        layout = mla_layout_refusal(attention, tuple(cls.capabilities.mla.layouts), [])
        reasons += [] if layout is None else [layout]
    return "; ".join(reasons) or None


#: vLLM's CPU platform's log line when it overrides the block size asked for
#: (``CpuPlatform.check_and_update_config``).
BLOCK_OVERRIDE = re.compile(
    r"CPU MLA backend requires block_size=(\d+), overriding user-specified block_size=(\d+)"
)


def attnhub_run(
    model: str, attention: str, provider: str | None, dtype: str, tmp: Path, name: str = "h4"
) -> dict:
    """One engine run of model ``name`` through attnhub's MLA backend (cached): block 16 as
    vLLM's run, or the run's own (:data:`RUN_BLOCK`)."""
    block = RUN_BLOCK.get(provider or "", 16)
    why = _mla_refusal(attention, provider, dtype, name, block)
    if why is not None:
        pytest.skip(f"attnhub's {attention} backend cannot serve this MLA model here: {why}")
    key = (attention, provider, dtype, name)
    if key in _ENGINE_SKIPS:
        pytest.skip(_ENGINE_SKIPS[key])
    if key not in _ATTNHUB_RUNS:
        out = tmp / f"mla-{attention}-{provider}-{dtype}-{name}.json"
        args = ["--attention", attention, "--model", model, "--dtype", dtype]
        args += ["--block-size", str(block), "--max-tokens", str(MAX_TOKENS), "--vary-max-tokens"]
        env = {"ATTNHUB_FLASH_PROVIDER": provider} if provider else {}
        proc = _run_script(*args, "--out", str(out), env=env)
        log = proc.stdout + proc.stderr
        forced = BLOCK_OVERRIDE.search(log)
        if proc.returncode and forced and "AttnhubConfigurationError" in log:
            # vLLM's CPU platform runs an MLA model at the block size its CPU_MLA kernel is
            # compiled for, whoever serves the layers (wherever it does not pick AMX_MLA),
            # and the backend refused the layer at that block size at engine start
            refusal = re.findall(r"- (MLA block_size .+)$", log, re.MULTILINE)
            _ENGINE_SKIPS[key] = (
                f"vLLM's CPU platform runs this MLA model at block_size {forced[1]} whoever "
                f"serves its layers ('{forced[0]}', CpuPlatform.check_and_update_config), "
                f"and {attention} ({provider}) refuses it at engine start: "
                f"{refusal[-1] if refusal else log[-500:]}"
            )
            pytest.skip(_ENGINE_SKIPS[key])
        assert proc.returncode == 0, log[-6000:]
        _ATTNHUB_RUNS[key] = json.loads(out.read_text()) | {"log": log}
    return _ATTNHUB_RUNS[key]


def vllm_cpu_mla_run(model: str, dtype: str, tmp: Path, name: str = "h4") -> dict:
    """vLLM's own run with ``CPU_MLA`` (block 16): what attnhub's runs are compared with."""
    result, backend, _ = run(model, dtype, tmp, name)
    if backend != "CPU_MLA":
        pytest.skip(f"vLLM picks {backend} on this CPU (block 32); attnhub's runs are at block 16")
    return result


def _runs(
    tmp_path_factory: pytest.TempPathFactory,
    tmp: Path,
    attention: str,
    provider: str | None,
    dtype: str,
    model: str,
) -> tuple[dict, dict]:
    path = write_model(model, tmp_path_factory)
    ref = vllm_cpu_mla_run(path, dtype, tmp, model)
    return ref, attnhub_run(path, attention, provider, dtype, tmp, model)


@pytest.mark.parametrize(("attention", "provider", "dtype", "model"), ATTNHUB_RUNS)
def test_attnhub_serves_the_mla_layers_with_vllms_tokens(
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    attention: str,
    provider: str | None,
    dtype: str,
    model: str,
) -> None:
    ref, got = _runs(tmp_path_factory, tmp_path, attention, provider, dtype, model)
    classes = {lay["backend_class"] for lay in got["attention_layers"]}
    assert classes == {"attnhub_vllm.mla.AttnhubVllmMLABackend"}, got["attention_layers"]
    served = got["attnhub_backends"]
    assert len(served) == 1 and f"'{attention}'" in served[0], served
    if attention not in ("torch", "cpu"):  # vendor backends run through their CPU emulators
        assert "emulated" in served[0], served
    if provider is not None:  # the provider asked for served the layers
        assert f"({provider})" in served[0], served
    # the same batches: decodes first, the same requests' query lengths in every step
    assert [s["query_lens"] for s in got["steps"]] == [s["query_lens"] for s in ref["steps"]]
    mixed = [s for s in ref["steps"] if 1 in s["query_lens"] and max(s["query_lens"]) > 1]
    assert mixed, "no step mixed decodes (forward_mqa) and prefills (forward_mha)"
    n = len(ref["token_ids"])
    label = f"MLA {attention}" + (f" ({provider})" if provider else "") + f" {model}"
    if dtype == "float32":
        assert got["token_ids"] == ref["token_ids"]
        print(f"\n{label} fp32: {n}/{n} prompts identical; {len(mixed)} mixed steps")
    else:
        notes = _compare_bf16(ref, got)
        same = sum(a == b for a, b in zip(ref["token_ids"], got["token_ids"], strict=True))
        print(f"\n{label} bf16: {same}/{n} prompts identical; " + "; ".join(notes))


@pytest.mark.parametrize(("attention", "provider", "dtype", "model"), ATTNHUB_RUNS)
def test_attnhub_mla_works_in_vllms_latent_cache_with_no_extra_bytes(
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    attention: str,
    provider: str | None,
    dtype: str,
    model: str,
) -> None:
    ref, got = _runs(tmp_path_factory, tmp_path, attention, provider, dtype, model)
    # vLLM allocates the same per-layer tensor whoever serves the layer ...
    shapes = [(lay["kv_cache_shape"], lay["bytes"]) for lay in got["attention_layers"]]
    assert shapes == [(lay["kv_cache_shape"], lay["bytes"]) for lay in ref["attention_layers"]]
    # ... and attnhub's latent cache lies in it: vLLM's joint plane itself, or (a backend that
    # reads split planes only: ascend) the two planes carved in place from its memory
    found = re.search(
        rf"backend '{attention}' MLA KV cache per layer: (\d+) bytes in vLLM's tensor, "
        r"(\d+) bytes extra \(latent layout '(\w+)'\)",
        got["log"],
    )
    assert found, got["log"][-3000:]
    assert int(found[1]) == ref["attention_layers"][0]["bytes"]
    assert int(found[2]) == 0
    layouts = _backend_class(attention, provider).capabilities.mla.layouts
    assert found[3] == ("joint" if "joint" in layouts else "split"), (found[0], layouts)


def _prefill_route(attention: str, provider: str | None, dtype: str, model: str) -> Any:
    """The adapter's decision for the tiny model's prefill on backend ``attention`` (with
    ``provider``), as the impl takes it at construction (``mla_prefill.prefill_route``)."""
    from attnhub_vllm.mla_prefill import prefill_route

    emulate = attention not in ("torch", "cpu")
    spec = spec_for(DTYPES[dtype], RUN_BLOCK.get(provider or "", 16), model)
    backend = _backend_class(attention, provider)(spec, "cpu", emulate=emulate)
    return prefill_route(backend, spec, "cpu", emulate)


@pytest.mark.parametrize(("attention", "provider", "dtype", "model"), ATTNHUB_RUNS)
def test_the_adapter_logs_who_served_the_mla_prefill(
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    attention: str,
    provider: str | None,
    dtype: str,
    model: str,
) -> None:
    """Every run's prefill path is logged once, at engine start (never a silent path): attnhub's
    expanded form (``torch``: keys 96, values 32 on h4) or vLLM's own ``forward_mha`` with the
    backend's reason (``cpu``: one head size for keys and values), as the adapter's rule
    decides for the backend; and the run's tokens are vLLM's
    (``test_attnhub_serves_the_mla_layers_with_vllms_tokens``) either way."""
    _, got = _runs(tmp_path_factory, tmp_path, attention, provider, dtype, model)
    found = re.findall(
        rf"backend '{attention}' MLA prefill \(forward_mha\): (attnhub|vLLM's own)([^\n]*)",
        got["log"],
    )
    assert found, got["log"][-3000:]
    assert len(set(found)) == 1, found  # one decision for the model's layers
    served, detail = found[0]
    route = _prefill_route(attention, provider, dtype, model)
    assert served == ("attnhub" if route.backend is not None else "vLLM's own"), found
    if (attention, model) == ("torch", "h4"):
        assert served == "attnhub", found
        assert "head_size 96, head_size_v 32" in detail, detail
    if attention == "cpu":
        assert served == "vLLM's own", found
        assert "vLLM's CPU kernels take one head_dim for query, key and value" in got["log"]
    print(f"\nMLA {attention} {provider or ''} {dtype} {model}: prefill {served}{detail[:120]}")


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


# --- ascend's split planes in vLLM's own memory: when the adapter allows them ---------------


def _ascend_impl(
    model: str, mutate: Any = None, nope_v: tuple[int, int] | None = None
) -> tuple[Any, Any]:
    """The adapter's MLA impl for the 32-head model's layer, served by ``ascend`` emulated,
    under a real ``VllmConfig`` (``vllm_generate.mla_layer_impl``); ``mutate`` changes the
    finished config first; ``nope_v`` another (qk_nope_head_dim, v_head_dim) for the layer."""
    from vllm_generate import mla_layer_impl

    g = MODELS["h32"]
    return mla_layer_impl(
        model,
        {"backend": "ascend", "emulate": True},
        num_heads=g["num_heads"],
        nope_v=nope_v or (g["qk_nope_head_dim"], g["v_head_dim"]),
        mutate=mutate,
    )


def _skip_unless_split_served() -> None:
    why = _mla_refusal("ascend", None, "bfloat16", "h32", 16)
    if why is not None:
        pytest.skip(f"ascend cannot serve the 32-head model's layers here: {why}")


def test_vllms_cpu_platform_rules_out_prefill_context_so_ascend_splits_in_place(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """vLLM's CPU platform turns chunked prefill and prefix caching off for an MLA model
    (``CpuPlatform.check_and_update_config``, where it does not pick AMX_MLA): no prefill has
    cached context, so vLLM's ``forward_mha`` never reads the cache, and the adapter keeps
    ascend's split planes in vLLM's own plane memory. A latent written through the adapter
    (the ascend emulator's write op) lies where the split view says: the kv_c plane of every
    block, then the k_pe plane, nothing else touched."""
    _skip_unless_split_served()
    if importlib.util.find_spec("attnhub_cpu") is not None:
        from attnhub_cpu import mla_ops, ops

        if mla_ops.vllm_mla_backend(ops.detect()) != "CPU_MLA":
            pytest.skip("vLLM's CPU platform picks AMX_MLA here (chunked prefill stays on)")
    impl, config = _ascend_impl(write_model("h32", tmp_path_factory))
    assert config.scheduler_config.enable_chunked_prefill is False
    assert config.cache_config.enable_prefix_caching is False
    assert impl.layout == "split"
    from vllm.forward_context import set_forward_context

    num_blocks, n = 5, 16
    g = torch.Generator().manual_seed(0)
    plane = torch.randn((num_blocks, n, 576), generator=g).to(torch.bfloat16)  # vLLM's kv_cache
    before = plane.clone()
    slots = torch.tensor([3, 17, -1, 79, 40])
    kv_c = torch.randn((5, 512), generator=g).to(torch.bfloat16)
    k_pe = torch.randn((5, 1, 64), generator=g).to(torch.bfloat16)
    with set_forward_context(None, config):  # a step with prefills: vLLM's slot mapping
        impl.do_kv_cache_update(kv_c, k_pe, plane, slots, "auto", torch.tensor(1.0))
    flat, edge = before.view(-1).clone(), num_blocks * n * 512
    want_c, want_pe = flat[:edge].view(-1, 512), flat[edge:].view(-1, 64)
    keep = slots >= 0
    want_c[slots[keep]] = kv_c[keep]
    want_pe[slots[keep]] = k_pe.reshape(5, 64)[keep]
    assert torch.equal(plane.view(-1), flat)
    assert impl._impl.backend.name == "ascend"
    cache = impl._cache
    assert cache.layout == "split" and cache.kv_c.data_ptr() == plane.data_ptr()
    assert cache.k_pe.data_ptr() == plane.data_ptr() + edge * plane.element_size()


SETTINGS = [
    (lambda c: setattr(c.cache_config, "enable_prefix_caching", True), "prefix caching"),
    (lambda c: setattr(c.scheduler_config, "enable_chunked_prefill", True), "chunked prefill"),
]


@pytest.mark.parametrize(("setting", "named"), SETTINGS, ids=["prefix-caching", "chunked-prefill"])
def test_split_latents_are_refused_where_vllms_own_prefill_would_read_context(
    tmp_path_factory: pytest.TempPathFactory, setting: Any, named: str
) -> None:
    """Where vLLM's config leaves chunked prefill or prefix caching on (vLLM's CPU platform
    with AMX_MLA, or another platform) and the layer's prefill stays vLLM's own (here: ascend
    takes the expanded form at 192 / 128 only, and its MLA form at most 16 query tokens, so a
    96 / 32 layer's prefill is vLLM's), vLLM's ``forward_mha`` gathers prefill context from the
    cache in its joint layout: the layer is refused at construction (engine start), naming the
    setting."""
    from attnhub_vllm.mapping import AttnhubConfigurationError

    _skip_unless_split_served()
    with pytest.raises(AttnhubConfigurationError, match=named) as refused:
        _ascend_impl(write_model("h32", tmp_path_factory), setting, nope_v=(32, 32))
    assert "'ascend' reads latent layouts split only" in str(refused.value)


@pytest.mark.parametrize(("setting", "named"), SETTINGS, ids=["prefix-caching", "chunked-prefill"])
def test_split_latents_stay_where_attnhub_serves_the_prefill_context_too(
    tmp_path_factory: pytest.TempPathFactory, setting: Any, named: str
) -> None:
    """With the same settings on, a 192 / 128 layer's prefill is attnhub's (the expanded form,
    its cached context read through attnhub's split view): nothing in vLLM reads the memory as
    its joint plane, so ascend keeps its split planes in place."""
    _skip_unless_split_served()
    impl, _ = _ascend_impl(write_model("h32", tmp_path_factory), setting)
    assert impl.layout == "split"
    assert impl.prefill_route.attnhub and impl.prefill_route.backend is not None
