"""The ``flash`` backend's MLA layers (the absorbed form) through FlashAttention-3's value
query: ``q_v`` of vLLM's fork (``fa_version=3``, provider ``vllm-fa3``), ``qv`` of upstream
FA3's ``flash_attn_with_kvcache`` (provider ``fa3``); and through FA4's ``qv`` of
``flash_attn.cute.flash_attn_varlen_func`` on SM100/SM110 (provider ``fa4``: latent (512, 64)
only, its LSE ``(total_q, nheads)``). The FA2 providers refuse MLA (``Capabilities.mla``'s
reason: docs/backends/flash.md "MLA").

The latent cache is vLLM's joint one (``concat_and_cache_mla``'s layout, what FLASH_ATTN_MLA
reads): one plane [num_blocks, block_size, kv_lora_rank + rope], ``kv_c`` then ``k_pe`` per
slot (fa3 also reads a "split" cache: FA3 takes K and V with strides of their own). The write:
vllm-fa3 calls vLLM's ``concat_and_cache_mla`` (``MLACommonImpl.do_kv_cache_update``), fa3 and
fa4 (no write op of their own) scatter the rows that have a slot. Per layer, as vLLM's
``FlashAttnMLAImpl.forward_mqa`` calls it [callers]:

  q   = query[..., kv_lora_rank:]          the rope part    [T, H, rope]
  q_v = query[..., :kv_lora_rank]          the latent part  [T, H, kv_lora_rank]
  k   = cache.k_pe.unsqueeze(-2)           the rope plane   [blocks, block_size, 1, rope]
  v   = cache.kv_c.unsqueeze(-2)           the latent plane [blocks, block_size, 1, kv_lora_rank]

scores ``q . k + q_v . v`` times the spec's scale, causal (bottom-right), output over ``v``: the
absorbed form exactly (keys ``[kv_c ; k_pe]``, values ``kv_c``) [doc: the interfaces' ``qv``;
callers: FLASH_ATTN_MLA]. Per step the builder plans the call's keyword arguments once for
every layer (int32 lengths and block table; on vllm-fa3 FA3's tile schedule by
``get_scheduler_metadata`` with ``headdim`` the rope size and ``headdim_v`` the latent rank, as
vLLM's ``FlashAttnMLAMetadataBuilder`` does) and the write's rows and slots; per layer the impl
makes one latent write and one attention call for the whole batch, the LSE from the same call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from attnhub.backend import AttentionMetadata, Step
from attnhub.errors import InvalidInputError
from attnhub.kit import as_contiguous
from attnhub.mla import LatentKVCache
from attnhub.mla_backend import MLAImpl, MLAMetadataBuilder

if TYPE_CHECKING:
    from attnhub_flash.backend import FlashBackend


@dataclass(frozen=True)
class FlashMLAMetadata(AttentionMetadata):
    """One MLA step, planned: the call's keyword arguments and the write's rows and slots."""

    provider: str = ""
    num_actual_tokens: int = 0
    #: the provider's keyword arguments of the step's one call but the layer's tensors
    kwargs: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    slot_mapping: torch.Tensor | None = None  # [num_tokens] int64, dense (vLLM's write)
    write_rows: torch.Tensor | None = None  # [m] int64: tokens that have a slot (scatter)
    write_slots: torch.Tensor | None = None  # [m] int64: their slots


class FlashMLAMetadataBuilder(MLAMetadataBuilder):
    metadata_type = FlashMLAMetadata
    backend: FlashBackend

    def plan(self, step: Step) -> Mapping[str, Any]:
        backend, batch = self.backend, step.batch
        n = batch.num_actual_tokens
        fields: dict[str, Any] = dict(provider=backend.provider, num_actual_tokens=n)
        if n:
            fields["kwargs"] = backend.kernels.mla_kwargs(
                backend,
                as_contiguous(batch.query_start_loc),  # int32, once per step
                batch.max_query_len,
                as_contiguous(batch.seq_lens),
                batch.max_seq_len,
                as_contiguous(batch.block_table),
            )
        fields.update(backend.kernels.mla_plan_write(batch, backend.device))
        return fields


class FlashMLAImpl(MLAImpl):
    """One MLA layer: one latent write, one value-query call."""

    backend: FlashBackend

    def __init__(self, backend: FlashBackend) -> None:
        super().__init__(backend)
        #: concat_and_cache_mla's scale (read for fp8 caches only), made once per layer
        self.unit_scale = torch.ones(1, dtype=torch.float32, device=backend.device)

    def check_call(self, cache: LatentKVCache, meta: AttentionMetadata) -> None:
        if not isinstance(meta, FlashMLAMetadata) or meta.provider != self.backend.provider:
            raise InvalidInputError(
                "meta must come from this flash backend's metadata_builder().build(batch) for "
                f"this MLA layer (provider {self.backend.provider}), got {type(meta).__name__}"
            )

    def store_kv(
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        cache: LatentKVCache,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata | None = None,
    ) -> None:
        kernels = self.backend.kernels
        if isinstance(meta, FlashMLAMetadata):  # a step's write, as the builder planned it
            plan = {
                "slot_mapping": meta.slot_mapping,
                "write_rows": meta.write_rows,
                "write_slots": meta.write_slots,
            }
        else:  # write_kv with a slot mapping alone (checked on the host by the base class)
            plan = kernels.mla_plan_slots(slot_mapping.cpu(), slot_mapping, self.backend.device)
        kernels.mla_write(self, kv_c, k_pe, cache, plan)

    def attend(
        self,
        query: torch.Tensor,  # [T, H, R + P]
        cache: LatentKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,  # [T, H, R]
        lse: torch.Tensor | None = None,  # [T, H] float32
    ) -> None:
        assert isinstance(meta, FlashMLAMetadata)
        n = meta.num_actual_tokens
        if n == 0:
            return
        o = out[:n]
        kernels = self.backend.kernels
        result, kernel_lse = kernels.mla_attend(
            self.backend, query[:n], cache, meta.kwargs, o, lse is not None
        )
        if result is not o:
            o.copy_(result)
        if lse is not None:
            assert kernel_lse is not None
            kernels.store_lse(lse[:n], kernel_lse, None)
