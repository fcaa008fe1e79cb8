"""The ``vllm.general_plugins`` entry point: route vLLM's attention to attnhub on request.

Active when ``ATTNHUB_BACKEND`` names an attnhub backend, or when ``ATTNHUB_VLLM=1`` (attnhub
then picks the best available backend). ``ATTNHUB_VLLM=0`` turns it off. vLLM runs general
plugins in every process it starts, so the choice follows the environment. Standard layers go
to ``attnhub_vllm.backend``, MLA layers (DeepSeek-V2/V3) to ``attnhub_vllm.mla``.

Also attnhub's plugin (entry-point group ``attnhub``): ``attnhub bench --host`` times vLLM's
CPU backend beside attnhub's (``attnhub_vllm.bench``; hook ``attnhub_host_comparisons``).
Importing this module imports neither vLLM nor torch.
"""

from __future__ import annotations

import os
from typing import Any

from attnhub.hookspecs import HostComparison, hookimpl
from attnhub_vllm import BACKEND_CLASS_PATH, MLA_BACKEND_CLASS_PATH

#: ``attnhub_vllm.bench.VLLM_CPU``, without importing torch here.
VLLM_CPU = "vllm CPU_ATTN"


#: vLLM's MLA backends the plugin replaces with attnhub's (``attnhub_vllm.mla``).
MLA_BACKENDS = ("CPU_MLA", "AMX_MLA")


def enabled() -> bool:
    flag = os.environ.get("ATTNHUB_VLLM", "").strip().lower()
    if flag in ("0", "false", "no", "off"):
        return False
    return flag in ("1", "true", "yes", "on") or bool(os.environ.get("ATTNHUB_BACKEND"))


def register() -> None:
    if not enabled():
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    # CUSTOM: platforms that honour an explicit attention_backend="CUSTOM" (and the name the
    # backend class reports). CPU_ATTN: vLLM's CPU platform always picks CPU_ATTN and ignores
    # CUSTOM, but honours an override of it.
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS_PATH)
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_CLASS_PATH)
    # MLA layers (DeepSeek-V2/V3): vLLM's CPU platform picks CPU_MLA, or AMX_MLA where the CPU
    # has AMX tiles (vllm/platforms/cpu.py); attnhub's MLA backend takes both places. (CUSTOM
    # holds the standard backend: a vLLM backend class is MLA or not, never both.)
    for name in MLA_BACKENDS:
        member = getattr(AttentionBackendEnum, name, None)
        if member is not None:  # a vLLM build without that backend has nothing to replace
            register_backend(member, MLA_BACKEND_CLASS_PATH)


def _unavailable(device: str) -> str | None:
    from attnhub_vllm.bench import vllm_cpu_unavailable

    return vllm_cpu_unavailable(device)


def _host_overhead(step: str) -> Any:
    from attnhub_vllm.bench import vllm_host_overhead

    return vllm_host_overhead(step)


@hookimpl
def attnhub_host_comparisons() -> list[HostComparison]:
    return [HostComparison(VLLM_CPU, _unavailable, _host_overhead)]
