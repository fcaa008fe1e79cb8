"""The ``vllm.general_plugins`` entry point: route vLLM's attention to attnhub on request.

Active when ``ATTNHUB_BACKEND`` names an attnhub backend, or when ``ATTNHUB_VLLM=1`` (attnhub
then picks the best available backend). ``ATTNHUB_VLLM=0`` turns it off. vLLM runs general
plugins in every process it starts, so the choice follows the environment.
"""

from __future__ import annotations

import os

from attnhub_vllm import BACKEND_CLASS_PATH


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
