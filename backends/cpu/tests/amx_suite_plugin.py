"""A pytest plugin (``-p amx_suite_plugin``) for running the conformance suite on the cpu
backend's amx path on any CPU vLLM's ``_C`` build loads on: registers ``cpu-amx``, the backend
as on an AMX CPU (``amx_standin.AmxCpuBackend``), declaring exactly the specs vLLM runs on
``amx`` (bfloat16, blocks in multiples of 32, head sizes in multiples of 32), so every case of
the suite runs vLLM's amx KV write into an AMX-packed cache and the amx scheduler plan; its MLA
cases run on ``AMX_MLA`` (bfloat16, blocks in multiples of 32, ``capabilities.mla`` as vLLM's
pick on an AMX CPU declares it: every query length), through vLLM's own write, decode and
extend ops."""

from __future__ import annotations

import dataclasses

import torch
from amx_standin import AmxCpuBackend

import attnhub


class AmxOnlyCpuBackend(AmxCpuBackend):
    name = "cpu-amx"
    capabilities = dataclasses.replace(
        AmxCpuBackend.capabilities,
        dtypes=frozenset({torch.bfloat16}),
        block_size_multiple=32,
        head_sizes=frozenset(h for h in AmxCpuBackend.capabilities.head_sizes if h % 32 == 0),
    )


attnhub.register_backend(AmxOnlyCpuBackend)
