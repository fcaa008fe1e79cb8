"""Run one greedy generation through a real vLLM engine and print the result as JSON.

    python vllm_generate.py --attention {vllm,torch,cpu,ascend,iluvatar,flash} --model DIR
        [--dtype ...] [--summary]   (host time per step and per layer: the adapter's benchmark)
        [--outside-kernels]   (vllm and cpu: the kernels timed too, host time outside them)

``--attention vllm`` runs vLLM's own CPU backend (for an MLA model, the one vLLM selects on
this CPU: ``CPU_MLA``, or ``AMX_MLA`` with AMX); any other value is an attnhub backend name
(the plugin is activated through ``ATTNHUB_BACKEND``; for an MLA model its MLA backend,
``attnhub_vllm.mla``, takes the place of vLLM's). Run each in its own process: vLLM's
backend registry and the plugin's choice are process-wide. The model directory is written by
``write_tiny_llama`` or ``write_tiny_deepseek_v2`` (random weights, no hub access). The result
names each attention layer's vLLM backend and the KV-cache tensor vLLM allocated for it. Every
step's batch composition is recorded from the metadata builder, as evidence of mixed
decode/prefill batches and chunked prefills.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable


def write_tiny_llama(path: str, seed: int = 0, num_kv_heads: int = 2) -> str:
    """A 2-layer Llama (hidden 256, 8 query / ``num_kv_heads`` KV heads, head 64, vocab 1000),
    random weights in safetensors. Larger-than-default init makes greedy choices robust to
    rounding ties. ``num_kv_heads=1`` (MQA) is the model vLLM allows decode context parallel
    for at ``tensor_parallel_size=2`` (vllm/config/model.py: TP must exceed the KV heads)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=num_kv_heads,
        head_dim=64,  # a head size every in-repo backend declares (ascend: 64, 128, 192, 256)
        max_position_embeddings=1024,
        initializer_range=0.08,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path


def write_tiny_deepseek_v2(
    path: str,
    seed: int = 0,
    *,
    num_heads: int = 4,
    qk_nope_head_dim: int = 32,
    v_head_dim: int = 32,
    hidden_size: int = 256,
) -> str:
    """A 2-layer DeepSeek-V2 (MLA: kv_lora_rank 512 and qk_rope_head_dim 64, the one geometry
    vLLM's CPU MLA decode kernel is compiled for; no q LoRA; vocab 1000; both layers dense:
    ``first_k_dense_replace`` = the layer count, so the tiny MoE configured is never built),
    random weights in safetensors. By default 4 heads with qk_nope / v head 32, hidden 256;
    ``num_heads=32, qk_nope_head_dim=128, v_head_dim=128`` gives DeepSeek's own per-head
    geometry (keys 192, values 128) at a head count the vendor kernels take (FIA's MLA form:
    query N 32, 64 or 128), still small (hidden 256: ~7 M parameters per layer)."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    config = DeepseekV2Config(
        vocab_size=1000,
        hidden_size=hidden_size,
        intermediate_size=512,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        first_k_dense_replace=2,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=qk_nope_head_dim,
        v_head_dim=v_head_dim,
        head_dim=64,
        max_position_embeddings=1024,
        initializer_range=0.08,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path


_TINY_DEEPSEEK: list[str] = []


def tiny_deepseek_v2_once() -> str:
    """The default tiny DeepSeek-V2 (:func:`write_tiny_deepseek_v2`), written once per process
    into a temporary directory: the model the adapter's unit tests build vLLM configs of."""
    if not _TINY_DEEPSEEK:
        import tempfile

        _TINY_DEEPSEEK.append(write_tiny_deepseek_v2(tempfile.mkdtemp(prefix="tiny-dsv2-")))
    return _TINY_DEEPSEEK[0]


def mla_layer_impl(
    model: str,
    attnhub: dict,
    *,
    num_heads: int,
    nope_v: tuple[int, int],
    dtype: str = "bfloat16",
    block_size: int = 16,
    kv_cache_dtype: str = "auto",
    mutate: Callable[[object], None] | None = None,
) -> tuple[object, object]:
    """The adapter's MLA impl for one layer of ``model`` (latent 512, rope 64), as vLLM's
    ``MLAAttention`` builds it under a real ``VllmConfig`` (its platform has adjusted the
    config: ``VllmConfig.__post_init__`` calls ``check_and_update_config``), and that config.
    ``attnhub``: the adapter's settings (``additional_config["attnhub"]``); ``nope_v``: the
    layer's (qk_nope_head_dim, v_head_dim); ``mutate(config)`` changes the finished config
    first (what another platform, or a user, may leave on). No weights: enough for the latent
    write, the decode and the adapter's checks."""
    from attnhub_vllm.mla import AttnhubVllmMLAImpl
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )

    config = VllmConfig(
        model_config=ModelConfig(model=model, dtype=dtype, max_model_len=256),
        cache_config=CacheConfig(block_size=block_size, cache_dtype=kv_cache_dtype),
        device_config=DeviceConfig(device="cpu"),
        additional_config={"attnhub": attnhub},
    )
    if mutate is not None:
        mutate(config)
    nope, v = nope_v
    with set_current_vllm_config(config):
        impl = AttnhubVllmMLAImpl(
            num_heads, 512 + 64, 0.1, 1, None, None, kv_cache_dtype, None, "decoder", None,
            q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=nope, qk_rope_head_dim=64,
            qk_head_dim=nope + 64, v_head_dim=v, kv_b_proj=None,
        )  # fmt: skip
    return impl, config


def interpreted_kernel(source: object) -> object:
    """A vLLM Triton kernel's source under the real ``triton.jit``, run by Triton's
    interpreter on the CPU (vLLM's CPU build stubs Triton out: its kernels are plain
    functions there). Sets ``TRITON_INTERPRET=1`` for this process."""
    import types

    os.environ["TRITON_INTERPRET"] = "1"
    import triton

    fn = getattr(source, "fn", source)
    scope = {**fn.__globals__, "tl": triton.language, "triton": triton}  # type: ignore[attr-defined]
    plain = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__)  # type: ignore[attr-defined]
    plain.__module__, plain.__qualname__ = fn.__module__, fn.__qualname__  # type: ignore[attr-defined]
    kernel = triton.jit(plain)
    if not hasattr(kernel, "constexprs"):  # read by vLLM's launchers: every argument positional
        kernel.constexprs = []
    return kernel


def interpret_dcp_slot_mapping() -> None:
    """Run vLLM's own DCP slot-mapping Triton kernel (``ComputeSlotMappingKernel``, what its
    GPU build runs) through Triton's interpreter in every worker, in place of the CPU fallback
    vLLM's CPU platform registers (``vllm/utils/cpu_triton_utils.py``), which refuses a
    context-parallel world above 1. A test stand-in for what vLLM lacks on CPU, nothing of
    attnhub's. vLLM's CPU platform spawns its workers (``VLLM_WORKER_MULTIPROC_METHOD=spawn``),
    which import this script as ``__mp_main__``: with ``INTERPRET_ENV`` set, each patches its
    platform there, before its worker registers the overrides (then this kernel)."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.worker.block_table import ComputeSlotMappingKernel

    kernel = interpreted_kernel(ComputeSlotMappingKernel.__dict__["kernel"].__func__)
    register = CpuPlatform.register_triton_kernel_overrides.__func__  # type: ignore[attr-defined]

    def overrides(cls: type) -> None:
        register(cls)
        ComputeSlotMappingKernel.kernel = staticmethod(kernel)  # type: ignore[assignment]

    CpuPlatform.register_triton_kernel_overrides = classmethod(overrides)  # type: ignore[assignment]


def is_mla_model(path: str) -> bool:
    """Whether the model directory holds an MLA model (DeepSeek-V2/V3 architecture)."""
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f).get("model_type") in ("deepseek_v2", "deepseek_v3")


def attention_layers(llm: object) -> list[dict]:
    """Each attention layer of the engine: vLLM's backend name and the KV-cache tensor vLLM
    bound to it (shape, dtype, bytes per block: all of a block's bytes, whatever the layout)."""
    ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context  # type: ignore[attr-defined]
    layers = []
    for name, layer in ctx.items():
        backend = getattr(layer, "attn_backend", None)
        kv = getattr(layer, "kv_cache", None)
        kv = kv[0] if isinstance(kv, list) and kv else kv
        if backend is None or kv is None or not hasattr(kv, "shape"):
            continue
        layers.append(
            {
                "name": name,
                "backend": backend.get_name(),
                "backend_class": f"{backend.__module__}.{backend.__qualname__}",
                "kv_cache_shape": list(kv.shape),
                "kv_cache_dtype": str(kv.dtype).removeprefix("torch."),
                "bytes": kv.numel() * kv.element_size(),
            }
        )
    return layers


PROMPT_LENS = (3, 17, 45, 130, 260, 9, 70, 200, 33, 150)


def prompts(seed: int = 1) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    # ids 3.. avoid bos/eos so no request stops early
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in PROMPT_LENS]


#: Thread CPU time spent so far inside vLLM's CPU attention kernels (ns), when
#: :func:`record_kernels` wraps them; each recorder stores its calls' share.
KERNEL_NS = [0]


def record_kernels(attention: str) -> bool:
    """Time vLLM's CPU attention kernels (scheduler metadata, KV write, attention) inside each
    call, for vLLM's own backend or attnhub's ``cpu`` backend (the same kernels): the report
    then also gives the host time outside them, which the kernels' load-dependent time does
    not blur. False for other backends (no such kernels)."""

    def timed(op):  # type: ignore[no-untyped-def]
        def call(*a, **k):  # type: ignore[no-untyped-def]
            c0 = time.thread_time_ns()
            try:
                return op(*a, **k)
            finally:
                KERNEL_NS[0] += time.thread_time_ns() - c0

        return call

    if attention == "vllm":
        from vllm.v1.attention.backends import cpu_attn

        for name in (
            "cpu_attn_get_scheduler_metadata",
            "cpu_attn_reshape_and_cache",
            "cpu_attention_with_kv_cache",
        ):
            setattr(cpu_attn.ops, name, timed(getattr(cpu_attn.ops, name)))
        return True
    if attention == "cpu":
        from attnhub_cpu import ops

        kernels = ops.kernels

        class Timed:  # the op namespace, each op timed
            def __init__(self, inner: object) -> None:
                self.inner = inner

            def __getattr__(self, name: str) -> object:
                return timed(getattr(self.inner, name))

        ops.kernels = lambda: Timed(kernels())
        return True
    return False


def record_steps(builder_cls: type, steps: list[dict]) -> None:
    """Wrap ``builder_cls.build`` to record every step's query and context lengths."""
    original = builder_cls.build

    def build(self, common_prefix_len, cm, fast_build=False):  # type: ignore[no-untyped-def]
        n = cm.num_reqs
        qsl = cm.query_start_loc_cpu[: n + 1]
        q = (qsl[1:] - qsl[:-1]).tolist()
        s = cm.seq_lens[:n].tolist()
        steps.append({"query_lens": q, "context_lens": [b - a for a, b in zip(q, s, strict=True)]})
        k0, c0, t0 = KERNEL_NS[0], time.thread_time_ns(), time.perf_counter_ns()
        meta = original(self, common_prefix_len, cm, fast_build)
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        steps[-1]["build_us"] = (t1 - t0) / 1e3
        steps[-1]["build_cpu_us"] = (c1 - c0) / 1e3
        steps[-1]["build_kernel_cpu_us"] = (KERNEL_NS[0] - k0) / 1e3
        return meta

    builder_cls.build = build


def record_forward(
    impl_cls: type, times: list[float], cpu: list[float], kernel: list[float]
) -> None:
    """Wrap ``impl_cls.forward`` to time every per-layer call: wall time in ``times``, this
    thread's CPU time in ``cpu`` (what the call itself spent, whatever else the machine runs;
    with one OpenMP thread the kernels run on this thread)."""
    original = impl_cls.forward

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **k):  # type: ignore[no-untyped-def]
        k0, c0, t0 = KERNEL_NS[0], time.thread_time_ns(), time.perf_counter_ns()
        out = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **k)
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        if attn_metadata is not None:
            times.append((t1 - t0) / 1e3)
            cpu.append((c1 - c0) / 1e3)
            kernel.append((KERNEL_NS[0] - k0) / 1e3)
        return out

    impl_cls.forward = forward


def record_kv_update(
    impl_cls: type, times: list[float], cpu: list[float], kernel: list[float]
) -> None:
    """Wrap ``impl_cls.do_kv_cache_update`` to time every per-layer KV write (wall and thread
    CPU time, as :func:`record_forward`)."""
    original = impl_cls.do_kv_cache_update

    def do_kv_cache_update(self, *a, **k):  # type: ignore[no-untyped-def]
        k0, c0, t0 = KERNEL_NS[0], time.thread_time_ns(), time.perf_counter_ns()
        original(self, *a, **k)
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        times.append((t1 - t0) / 1e3)
        cpu.append((c1 - c0) / 1e3)
        kernel.append((KERNEL_NS[0] - k0) / 1e3)

    impl_cls.do_kv_cache_update = do_kv_cache_update


def summary(
    result: dict, label: str | None = None, *, cpu: bool = False, outside: bool = False
) -> str:
    """Medians over the decode-only steps (past the first four: warm): wall time, or with
    ``cpu`` this thread's CPU time (steady on a shared machine, where wall time also counts
    the time other processes hold the core), or with ``outside`` the CPU time outside vLLM's
    CPU kernels (runs made with ``--outside-kernels``)."""
    import statistics

    steps = result["steps"]
    if outside:

        def minus(cpu_times: list[float], kernel_times: list[float]) -> list[float]:
            return [c - k for c, k in zip(cpu_times, kernel_times, strict=True)]

        fwd = minus(result["forward_cpu_us"], result["forward_kernel_cpu_us"])
        kvu = minus(result["kv_update_cpu_us"], result["kv_update_kernel_cpu_us"])
        build = [s["build_cpu_us"] - s["build_kernel_cpu_us"] for s in steps]
        mode = " (CPU time outside the kernels)"
    else:
        suffix = "_cpu_us" if cpu else "_us"
        fwd, kvu = result["forward" + suffix], result["kv_update" + suffix]
        build = [s["build" + suffix] for s in steps]
        mode = " (CPU time)" if cpu else ""
    layers = len(fwd) // max(len(steps), 1)
    warm = range(min(4, len(steps)), len(steps))
    decode = [i for i in warm if max(steps[i]["query_lens"]) == 1]
    label = (label or f"{result['attention']} {result['dtype']}") + mode
    if not decode:
        return f"{label}: no decode-only step"

    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    per_layer = [i * layers + j for i in decode for j in range(layers)]
    return (
        f"{label}: {len(decode)} warm decode-only steps of "
        f"{med([len(steps[i]['query_lens']) for i in decode]):.0f} requests: build "
        f"{med([build[i] for i in decode]):.0f} us/step, forward "
        f"{med([fwd[i] for i in per_layer]):.0f} us/layer, KV write "
        f"{med([kvu[i] for i in per_layer if i < len(kvu)]):.0f} us/layer"
    )


def _attnhub_backends() -> list[str]:
    """The attnhub backends this process's engine used (none when attnhub was off)."""
    if "attnhub_vllm.backend" not in sys.modules:
        return []
    from attnhub_vllm.backend import _BACKENDS

    return sorted({repr(b) for b in _BACKENDS.values()})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attention", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument(
        "--attnhub-config",
        default=None,
        help='JSON for additional_config["attnhub"]: choose the attnhub backend in vLLM\'s '
        "config instead of ATTNHUB_BACKEND (attention is then routed with ATTNHUB_VLLM=1)",
    )
    ap.add_argument(
        "--logprobs",
        type=int,
        default=5,
        help="logprobs recorded per step: the N most likely tokens and the chosen one; -1: "
        "every token of the vocabulary (a token's logprob however unlikely the run finds it)",
    )
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument(
        "--vary-max-tokens",
        action="store_true",
        help="prompt i generates max_tokens + i %% 4 tokens: requests finish at different "
        "steps, so later prompts are prefilled beside decodes (mixed steps) even where vLLM "
        "turns chunked prefill off (MLA on CPU)",
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=6)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument(
        "--decode-context-parallel-size",
        type=int,
        default=1,
        help="vLLM's decode_context_parallel_size (within the tensor-parallel group)",
    )
    ap.add_argument("--cp-kv-cache-interleave-size", type=int, default=1)
    ap.add_argument(
        "--interpret-dcp-slot-mapping",
        action="store_true",
        help="vLLM's own DCP slot-mapping Triton kernel, interpreted, in place of the CPU "
        "fallback that refuses decode context parallel (interpret_dcp_slot_mapping)",
    )
    ap.add_argument("--out", required=True, help="where to write the JSON result")
    ap.add_argument(
        "--summary", action="store_true", help="print host times per step and per layer"
    )
    ap.add_argument(
        "--outside-kernels",
        action="store_true",
        help="time vLLM's CPU attention kernels inside each call (vllm and cpu only) and "
        "report the host time outside them too",
    )
    args = ap.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    additional_config = {}
    if args.attnhub_config is not None:
        additional_config["attnhub"] = json.loads(args.attnhub_config)
        os.environ["ATTNHUB_VLLM"] = "1"
        os.environ.pop("ATTNHUB_BACKEND", None)
        os.environ.pop("ATTNHUB_EMULATE", None)
    elif args.attention == "vllm":
        os.environ["ATTNHUB_VLLM"] = "0"
        os.environ.pop("ATTNHUB_BACKEND", None)
    else:
        os.environ["ATTNHUB_BACKEND"] = args.attention
        if args.attention != "torch":
            os.environ["ATTNHUB_EMULATE"] = "1"  # vendor backends run through their emulators

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if args.interpret_dcp_slot_mapping:
        os.environ[INTERPRET_ENV] = "1"  # the workers' (spawned) copy of this script patches
        interpret_dcp_slot_mapping()

    steps: list[dict] = []
    mla = is_mla_model(args.model)
    Impl: type | None
    if mla:  # vLLM's MLA backends (attnhub's too) share this builder; no impl is timed here
        from vllm.model_executor.layers.attention.mla_attention import (
            MLACommonMetadataBuilder as B,
        )

        Impl = None
    elif args.attention == "vllm" and args.attnhub_config is None:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as Impl
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder as B
    else:
        from attnhub_vllm.backend import AttnhubVllmImpl as Impl
        from attnhub_vllm.backend import AttnhubVllmMetadataBuilder as B
    record_steps(B, steps)
    kernels_timed = args.outside_kernels and record_kernels(args.attention)
    forward_us: list[float] = []
    forward_cpu_us: list[float] = []
    forward_kernel_cpu_us: list[float] = []
    kv_update_us: list[float] = []
    kv_update_cpu_us: list[float] = []
    kv_update_kernel_cpu_us: list[float] = []
    if Impl is not None:
        record_forward(Impl, forward_us, forward_cpu_us, forward_kernel_cpu_us)
        record_kv_update(Impl, kv_update_us, kv_update_cpu_us, kv_update_kernel_cpu_us)

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=args.dtype,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=512,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_chunked_prefill=True,
        enable_prefix_caching=False,
        seed=0,
        kv_cache_memory_bytes=64 << 20,  # a small cache: no GBs of page faults at start
        max_logprobs=max(args.logprobs, 20) if args.logprobs >= 0 else -1,
        additional_config=additional_config,
        tensor_parallel_size=args.tensor_parallel_size,
        decode_context_parallel_size=args.decode_context_parallel_size,
        cp_kv_cache_interleave_size=args.cp_kv_cache_interleave_size,
    )
    start_s = time.perf_counter() - t0
    steps.clear()  # drop the warm-up / profiling steps
    for times in (forward_us, forward_cpu_us, forward_kernel_cpu_us):
        times.clear()
    for times in (kv_update_us, kv_update_cpu_us, kv_update_kernel_cpu_us):
        times.clear()
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=args.max_tokens + (i % 4 if args.vary_max_tokens else 0),
            detokenize=False,
            logprobs=args.logprobs,
            ignore_eos=True,
        )
        for i in range(len(PROMPT_LENS))
    ]
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts()], params)
    gen_s = time.perf_counter() - t0
    result = {
        "attention": args.attention,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "kv_cache_dtype": args.kv_cache_dtype,
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        # per prompt, per step: {token id: logprob} of the top --logprobs (and the sampled
        # token); with --logprobs -1, of every token
        "logprobs": [
            [{int(t): v.logprob for t, v in lp.items()} for lp in o.outputs[0].logprobs]
            for o in outs
        ],
        "forward_us": forward_us,
        "kv_update_us": kv_update_us,
        "forward_cpu_us": forward_cpu_us,  # this thread's CPU time of each call
        "kv_update_cpu_us": kv_update_cpu_us,
        # CPU time inside vLLM's CPU kernels per call (0 unless --outside-kernels timed them)
        "forward_kernel_cpu_us": forward_kernel_cpu_us,
        "kv_update_kernel_cpu_us": kv_update_kernel_cpu_us,
        "steps": steps,
        "engine_start_s": start_s,
        "generate_s": gen_s,
        # which attnhub backends served (e.g. "<FlashFA3Backend 'flash' (fa3) on cpu, emulated>")
        "attnhub_backends": _attnhub_backends(),
        "mla": mla,
        # where this process resolves attnhub (the tests check it is the tree under test)
        "attnhub_file": getattr(importlib.util.find_spec("attnhub"), "origin", None),
        # each attention layer: vLLM's backend name and the KV-cache tensor vLLM bound to it
        "attention_layers": attention_layers(llm),
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    if args.summary:
        print(summary(result))
        print(summary(result, cpu=True))
        if kernels_timed:
            print(summary(result, outside=True))
    return 0


#: Set by ``--interpret-dcp-slot-mapping`` for vLLM's spawned workers.
INTERPRET_ENV = "ATTNHUB_TEST_INTERPRET_DCP_SLOT_MAPPING"

if __name__ == "__mp_main__" and os.environ.get(INTERPRET_ENV) == "1":
    interpret_dcp_slot_mapping()  # a vLLM worker this script's engine spawned

if __name__ == "__main__":
    sys.exit(main())
