"""End to end, MLA, in vLLM's ``AMX_MLA`` engine configuration: a configuration run, not AMX
tiles. ``vllm_generate_amx.py`` makes ``torch.cpu._is_amx_tile_supported`` answer True before
vLLM is imported, so vLLM's CPU platform configures the tiny DeepSeek-V2 as on an AMX machine
(``AMX_MLA``, bfloat16, blocks of 32 as asked, chunked prefill and prefix caching left on),
and attnhub's ``cpu`` backend, which reads the same probe, takes its ``AMX_MLA`` path. The
kernels run their AVX512-BF16 code (oneDNN's brgemm without tiles): this checks the engine
configuration and the adapter, never AMX's numerics or speed. The prompts share a 96-token
prefix, so prefix caching (and chunked prefill) make prefills with cached context.

Three engines (~20 s each) on the 4-head model: vLLM's own ``AMX_MLA``, attnhub ``torch`` and
attnhub ``cpu``:
- vLLM's run: ``AMX_MLA`` in every layer, [num_blocks, 32, 576] bfloat16 latent planes, and
  prefills with cached context, prefix-cache hits among them;
- attnhub's runs: attnhub's MLA backend class in every layer, the same steps, the same greedy
  tokens under the project's bf16 criterion (``test_generate._compare_bf16``), vLLM's per-layer
  KV tensor and 0 bytes beside it; ``torch`` serves the prefills with cached context in the
  expanded form, ``cpu`` (which detects AMX in its process: its ``AMX_MLA`` path) in the
  absorbed form through its MLA impl, both logged.

Six more on the 32-head model (``h32``: DeepSeek's 192 / 128): vLLM's own ``AMX_MLA`` at
blocks 64 and 128 (the block asked kept: the platform forces 16 only without AMX_MLA), and
attnhub through ``torch`` (the control), ``flash`` ``vllm-fa3`` and ``flash``
``vllm-flashmla`` (FlashMLA pages by 64) at 64, and ``ascend`` (its MLA form pages by 16 or 128;
split planes carved in place) at 128, the vendors emulated, each against vLLM's run at its own
block (vLLM's own tokens change with the block here beyond the bf16 criterion): the bf16
criterion, attnhub's MLA class in every layer, 0 bytes extra, the prefills with cached context
through attnhub's expanded form (logged).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import vllm_generate_amx as amx
    from test_generate import _compare_bf16, vllm_refusal
    from test_generate_mla import _backend_class, _mla_refusal, write_model
finally:
    sys.path.remove(str(HERE))

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (nox -s vllm)"
)

SCRIPT = HERE / "vllm_generate_amx.py"
MAX_TOKENS = 8
BLOCK = 32  # AMX_MLA's blocks are multiples of 32 (AMXMLABackend.supports_block_size)
ATTNHUB = ["torch", "cpu"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    sys.path.insert(0, str(HERE))
    try:
        from vllm_generate import write_tiny_deepseek_v2
    finally:
        sys.path.remove(str(HERE))
    return write_tiny_deepseek_v2(str(tmp_path_factory.mktemp("tiny-deepseek-v2-amx")))


_RUNS: dict[tuple[str, str, str | None, int], dict] = {}


def run(
    model: str, attention: str, tmp: Path, block: int = BLOCK, provider: str | None = None
) -> dict:
    """One engine in the AMX_MLA configuration (cached per model, backend, flash provider and
    block size): the result and log. A run the adapter refuses at engine start is skipped with
    the refusal it logged."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"vLLM picks AMX_MLA on x86 only; this is {platform.machine()}")
    why = amx.refusal()
    if why is not None:
        pytest.skip(f"AMX_MLA's kernels cannot run on this CPU: {why}")
    if attention == "cpu" and importlib.util.find_spec("attnhub_cpu") is None:
        pytest.skip("attnhub-cpu is not installed")
    key = (model, attention, provider, block)
    if key not in _RUNS:
        out = tmp / f"amx-{attention}-{provider}-{block}.json"
        args = ["--attention", attention, "--model", model, "--dtype", "bfloat16"]
        args += ["--block-size", str(block), "--max-tokens", str(MAX_TOKENS), "--vary-max-tokens"]
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
        env.setdefault("OMP_NUM_THREADS", "1")
        if provider is not None:
            env["ATTNHUB_FLASH_PROVIDER"] = provider
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), *args, "--out", str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        log = proc.stdout + proc.stderr
        if proc.returncode and attention == "vllm" and vllm_refusal(log) is not None:
            pytest.skip(f"vLLM refused on this machine: {vllm_refusal(log)}")
        if proc.returncode and "AttnhubConfigurationError" in log:
            refused = re.findall(r"AttnhubConfigurationError: (.+)$", log, re.MULTILINE)
            pytest.skip(f"{attention} ({provider}) refused at engine start: {refused[-1:]}")
        assert proc.returncode == 0, log[-6000:]
        _RUNS[key] = json.loads(out.read_text()) | {"log": log}
    return _RUNS[key]


def context_prefills(result: dict) -> list[tuple[int, int]]:
    """(query_len, context_len) of every prefill with cached context in the run's steps."""
    return [
        (q, c)
        for s in result["steps"]
        for q, c in zip(s["query_lens"], s["context_lens"], strict=True)
        if q > 1 and c > 0
    ]


def test_vllm_configures_amx_mla_with_prefix_caching_and_context_prefills(
    model_dir: str, tmp_path: Path
) -> None:
    result = run(model_dir, "vllm", tmp_path)
    assert "Using AMX_MLA backend" in result["log"], result["log"][-3000:]
    assert "'enable_prefix_caching': True" in result["log"]
    assert [lay["backend"] for lay in result["attention_layers"]] == ["AMX_MLA", "AMX_MLA"]
    for lay in result["attention_layers"]:
        num_blocks = lay["kv_cache_shape"][0]
        assert lay["kv_cache_shape"] == [num_blocks, BLOCK, 576] and lay["kv_cache_dtype"] == (
            "bfloat16"
        ), lay
    ids = result["token_ids"]
    assert [len(t) for t in ids] == [MAX_TOKENS + i % 4 for i in range(len(ids))], ids
    ctx = context_prefills(result)
    # a prompt's tail prefilled in one step over the shared prefix, all of it from the cache
    hits = [(q, c) for q, c in ctx if c == amx.SHARED_PREFIX and q in amx.TAIL_LENS]
    assert hits, ctx
    print(f"\nAMX_MLA configuration: {len(ctx)} prefills with cached context, e.g. {ctx[:4]}")


@pytest.mark.parametrize("attention", ATTNHUB)
def test_attnhub_serves_the_amx_mla_engine_with_vllms_tokens_and_no_extra_bytes(
    model_dir: str, tmp_path: Path, attention: str
) -> None:
    ref = run(model_dir, "vllm", tmp_path)
    got = run(model_dir, attention, tmp_path)
    classes = {lay["backend_class"] for lay in got["attention_layers"]}
    assert classes == {"attnhub_vllm.mla.AttnhubVllmMLABackend"}, got["attention_layers"]
    served = got["attnhub_backends"]
    assert len(served) == 1 and f"'{attention}'" in served[0], served
    # the same scheduling: the same steps, prefills with cached context among them
    assert [s["query_lens"] for s in got["steps"]] == [s["query_lens"] for s in ref["steps"]]
    assert [s["context_lens"] for s in got["steps"]] == [s["context_lens"] for s in ref["steps"]]
    assert context_prefills(got)
    notes = _compare_bf16(ref, got)  # asserts the project's bf16 criterion
    same = sum(a == b for a, b in zip(ref["token_ids"], got["token_ids"], strict=True))
    # vLLM's per-layer tensor, and attnhub's latent cache a view of it
    shapes = [(lay["kv_cache_shape"], lay["bytes"]) for lay in got["attention_layers"]]
    assert shapes == [(lay["kv_cache_shape"], lay["bytes"]) for lay in ref["attention_layers"]]
    found = re.search(
        rf"backend '{attention}' MLA KV cache per layer: (\d+) bytes in vLLM's tensor, "
        r"(\d+) bytes extra",
        got["log"],
    )
    assert found, got["log"][-3000:]
    assert int(found[1]) == ref["attention_layers"][0]["bytes"] and int(found[2]) == 0
    n = len(ref["token_ids"])
    print(
        f"\nAMX_MLA configuration, {attention} bf16: {same}/{n} prompts identical; "
        + "; ".join(notes)
    )


def test_torch_serves_the_prefills_with_cached_context(model_dir: str, tmp_path: Path) -> None:
    got = run(model_dir, "torch", tmp_path)
    log = got["log"]
    assert "backend 'torch' MLA prefill (forward_mha): attnhub (the expanded form" in log, log[
        -3000:
    ]
    assert (
        "backend 'torch' MLA prefill with cached context served by attnhub: the context's "
        "latents read from the latent cache (layout 'joint')"
    ) in log, log[-3000:]


def test_cpu_takes_its_amx_mla_path_and_serves_the_context_prefills_absorbed(
    model_dir: str, tmp_path: Path
) -> None:
    """attnhub_cpu's detection follows the patched probe (its AMX_MLA path, which serves the
    blocks of 32 this engine runs: its CPU_MLA path takes 16 only); it serves no expanded form,
    so its prefills, cached context included, go through its MLA impl in the absorbed form
    (``extend_attention_cpu``, as vLLM's ``AMXMLAImpl.forward_mha``), logged."""
    got = run(model_dir, "cpu", tmp_path)
    log = got["log"]
    assert "attnhub_cpu detects AMX: MLA through AMX_MLA" in log, log[-3000:]
    assert "backend 'cpu' MLA prefill (forward_mha): attnhub (the absorbed form" in log, log[-3000:]
    assert (
        "backend 'cpu' MLA prefill with cached context served by attnhub: the absorbed form "
        "over the latent cache (layout 'joint')"
    ) in log, log[-3000:]


# --- the 32-head model through the emulated vendor backends ---------------------------------

#: attnhub runs of the 32-head model (DeepSeek's per-head geometry, ``h32``), each at a block
#: size its kernels page by, which vLLM keeps under this configuration (the CPU platform forces
#: block 16 only where it does not pick AMX_MLA): (backend, flash provider, block). ``torch``
#: is the control; ``ascend``'s MLA form pages by 16 or 128 (AMX_MLA: multiples of 32, so
#: 128), FlashMLA by 64, FA3 by multiples of 16: one vLLM reference at 64 serves three runs.
H32_RUNS = [
    pytest.param("torch", None, 64, id="torch-h32-b64"),
    pytest.param("flash", "vllm-fa3", 64, id="flash[vllm-fa3]-h32-b64"),
    pytest.param("flash", "vllm-flashmla", 64, id="flash[vllm-flashmla]-h32-b64"),
    pytest.param("ascend", None, 128, id="ascend-h32-b128"),
]


@pytest.fixture(scope="module")
def h32_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model("h32", tmp_path_factory)


def h32_run(model: str, attention: str, tmp: Path, block: int, provider: str | None = None) -> dict:
    """An h32 engine run; an attnhub backend that cannot serve the layer here is skipped with
    its reasons before an engine starts."""
    if attention != "vllm":
        why = _mla_refusal(attention, provider, "bfloat16", "h32", block)
        if why is not None:
            pytest.skip(f"{attention} ({provider}) cannot serve the h32 layers here: {why}")
    return run(model, attention, tmp, block, provider)


@pytest.mark.parametrize("block", [64, 128])
def test_vllm_runs_the_32_head_model_with_amx_mla_at_the_block_asked(
    h32_dir: str, tmp_path: Path, block: int
) -> None:
    """vLLM's own reference for each block the vendor runs use: AMX_MLA in every layer, the
    user's block size kept (no override line), prefills with cached context."""
    result = h32_run(h32_dir, "vllm", tmp_path, block)
    assert "Using AMX_MLA backend" in result["log"], result["log"][-3000:]
    assert "overriding user-specified block_size" not in result["log"]
    assert [lay["backend"] for lay in result["attention_layers"]] == ["AMX_MLA", "AMX_MLA"]
    for lay in result["attention_layers"]:
        assert lay["kv_cache_shape"][1:] == [block, 576], lay
        assert lay["kv_cache_dtype"] == "bfloat16", lay
    assert context_prefills(result)


def _check_served(got: dict, attention: str, provider: str | None) -> None:
    """attnhub's MLA class in every layer, through the backend (provider) asked for, emulated
    for the vendor backends."""
    classes = {lay["backend_class"] for lay in got["attention_layers"]}
    assert classes == {"attnhub_vllm.mla.AttnhubVllmMLABackend"}, got["attention_layers"]
    served = got["attnhub_backends"]
    assert len(served) == 1 and f"'{attention}'" in served[0], served
    if attention != "torch":
        assert "emulated" in served[0], served
    if provider is not None:
        assert f"({provider})" in served[0], served


def _check_cache_and_prefills(got: dict, ref: dict, attention: str, layout: str) -> None:
    """vLLM's per-layer tensor at the block asked, attnhub's latent cache in it (0 bytes extra,
    in ``layout``), and the prefills, cached context included, attnhub's expanded form."""
    shapes = [(lay["kv_cache_shape"], lay["bytes"]) for lay in got["attention_layers"]]
    assert shapes == [(lay["kv_cache_shape"], lay["bytes"]) for lay in ref["attention_layers"]]
    log = got["log"]
    found = re.search(
        rf"backend '{attention}' MLA KV cache per layer: (\d+) bytes in vLLM's tensor, "
        r"(\d+) bytes extra \(latent layout '(\w+)'\)",
        log,
    )
    assert found, log[-3000:]
    assert int(found[1]) == ref["attention_layers"][0]["bytes"] and int(found[2]) == 0
    assert found[3] == layout, found[0]
    assert (
        f"backend '{attention}' MLA prefill (forward_mha): attnhub (the expanded form: heads 32, "
        "head_size 192, head_size_v 128, bfloat16, causal"
    ) in log, log[-3000:]
    assert (
        f"backend '{attention}' MLA prefill with cached context served by attnhub: the "
        f"context's latents read from the latent cache (layout '{layout}')"
    ) in log, log[-3000:]


@pytest.mark.parametrize(("attention", "provider", "block"), H32_RUNS)
def test_the_vendors_serve_the_32_head_model_in_the_amx_mla_engine(
    h32_dir: str, tmp_path: Path, attention: str, provider: str | None, block: int
) -> None:
    """Against vLLM's own AMX_MLA run at the same block, step for step: vLLM's own tokens
    depend on the block size in this configuration beyond the bf16 criterion (measured: its
    runs at blocks 32 and 64 differ at prompt 0's first token, a gap of 0.375 nats, though that
    prompt's two prefill chunks are the same in both; attnhub ``torch`` at each block agrees
    with vLLM's at that block; with one request per step the two blocks agree bit for bit
    there: the shift comes with the step's other requests, cause not found), so a run at block
    64 or 128 is not compared with block 32."""
    ref = h32_run(h32_dir, "vllm", tmp_path, block)
    got = h32_run(h32_dir, attention, tmp_path, block, provider)
    _check_served(got, attention, provider)
    assert [s["query_lens"] for s in got["steps"]] == [s["query_lens"] for s in ref["steps"]]
    assert [s["context_lens"] for s in got["steps"]] == [s["context_lens"] for s in ref["steps"]]
    ctx = context_prefills(got)
    assert ctx
    layouts = _backend_class(attention, provider).capabilities.mla.layouts
    _check_cache_and_prefills(got, ref, attention, "joint" if "joint" in layouts else "split")
    notes = _compare_bf16(ref, got)  # asserts the project's bf16 criterion
    same = sum(a == b for a, b in zip(ref["token_ids"], got["token_ids"], strict=True))
    label = attention + (f" ({provider})" if provider else "")
    n = len(ref["token_ids"])
    print(
        f"\nAMX_MLA configuration, h32 block {block}, {label} bf16: {same}/{n} "
        f"prompts identical, {len(ctx)} prefills with cached context; " + "; ".join(notes)
    )
