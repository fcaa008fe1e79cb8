"""The backend protocol for MLA layers (the absorbed form): the same backend, builder and
validation as standard attention, and an impl whose call is vLLM's ``forward_mqa``.

An :class:`~attnhub.mla.MLASpec` goes through the same ``AttentionBackend`` (one constructor,
``unsupported_reasons`` from the declared ``Capabilities.mla``), the same
``metadata_builder().build(batch)`` (an MLA step's lengths, block tables and slot mapping are
the same arithmetic: ``check_step`` -> ``plan(step)`` -> ``metadata(step, planned)``) and an
impl of its own kind, because its call is another one::

    out = impl.forward(q, kv_c, k_pe, cache, meta)   # writes (kv_c, k_pe), then attends
    #   q     [T, H, kv_lora_rank + qk_rope_head_dim]  (= [q_nope @ W_UK ; q_pe])
    #   kv_c  [T, kv_lora_rank], k_pe [T, qk_rope_head_dim] (both None: nothing new)
    #   cache LatentKVCache in a declared layout
    #   out   [T, H, kv_lora_rank] in spec.dtype (the engine applies W_UV)

Every check runs before anything is written (a refusal leaves the cache byte-identical); a
backend implements ``store_kv(kv_c, k_pe, cache, slot_mapping, meta)`` and ``attend(query,
cache, meta, out, lse)``, or ``compute`` for a kernel that does both.
"""

from __future__ import annotations

import abc
import math
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np
import torch

from attnhub import validation
from attnhub.backend import AttentionMetadata, AttentionMetadataBuilder
from attnhub.capabilities import GraphSupport
from attnhub.errors import InvalidInputError, UnsupportedConfigurationError
from attnhub.mla import LatentKVCache, MLASpec, check_latent_cache, check_latent_kv

if TYPE_CHECKING:
    from attnhub.backend import AttentionBackend
    from attnhub.batch import BatchMetadata


class MLAMetadataBuilder(AttentionMetadataBuilder[Any]):
    """A step's metadata for MLA layers: ``build`` checks the step as for any layer (the same
    rules: only the spec's block size enters them) and refuses requests longer than the
    declared ``Capabilities.mla.max_query_len``; ``plan(step)`` is the backend's, as ever."""

    @property
    def graph_support(self) -> GraphSupport:
        return GraphSupport.NEVER  # no MLA capture is declared yet

    def _check_batch_kinds(self, batch: BatchMetadata) -> None:
        """Refuse requests longer than ``capabilities.mla.max_query_len`` (a decode-only
        kernel: 1), naming the first; and a non-causal batch with a request of query_len > 1
        (MLA layers are causal: no MLA kernel lets a query row see keys past its position,
        which ``batch.causal=False`` asks for; one-token queries see every key either way)."""
        if not batch.causal and batch.max_query_len > 1:
            q = batch.query_lens_cpu
            r = int(np.flatnonzero(q.numpy() > 1)[0])
            raise UnsupportedConfigurationError(
                self.backend.name,
                [
                    f"batch.causal is False and request {r} has query_len {int(q[r])}: MLA "
                    "layers are causal (bottom-right); a non-causal step is served only where "
                    "every query_len is 1 (each row then sees every key either way)"
                ],
            )
        longest = self.backend.capabilities.mla.max_query_len
        if longest is None or batch.max_query_len <= longest:
            return
        q = batch.query_lens_cpu
        r = int(np.flatnonzero(q.numpy() > longest)[0])
        kind = "prefill" if int(batch.seq_lens_cpu[r]) == int(q[r]) else "chunked prefill"
        raise UnsupportedConfigurationError(
            self.backend.name,
            [
                f"request {r} (query_len {int(q[r])}, context_len "
                f"{int(batch.seq_lens_cpu[r] - q[r])}) is a {kind}; this backend's MLA "
                f"kernels take query_len <= {longest}" + (" (decode only)" if longest == 1 else "")
            ],
        )


class MLAImpl(abc.ABC):
    """One MLA layer in the absorbed form: write the step's latents, then multi-query attention
    of every head over the latent cache (vLLM's ``MLACommonImpl.forward_mqa`` over
    ``do_kv_cache_update``'s cache)."""

    #: The metadata class this backend's builder makes (``check_call`` may insist on it).
    metadata_type: ClassVar[type[AttentionMetadata]] = AttentionMetadata

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend
        spec = backend.spec
        assert isinstance(spec, MLASpec)
        self.spec: MLASpec = spec
        mla = backend.capabilities.mla
        self._layouts = mla.layouts
        #: (cache, kv_c plane, k_pe plane, scale, num_slots, num_blocks) accepted last.
        self._checked_cache: tuple[Any, ...] | None = None
        #: What identified the fp8 scale's value each time it was found finite and non-zero
        #: (``validation.tensor_scale_key``).
        self._scales_seen = validation.CheckedStates()
        self._owner_ok: object = backend
        self._lse_refusal = mla.lse.refusal(spec)

    # --- checks ----------------------------------------------------------------------------
    def _accept_cache(self, cache: object) -> LatentKVCache:
        """The cache, checked (its planes once per cache; an fp8 scale's value once per change
        of the tensor, ``validation.check_tensor_scale_values``)."""
        latent = self._accept_planes(cache)
        if latent.scale is not None:
            key = validation.tensor_scale_key(latent, ("scale",))
            if key not in self._scales_seen:
                validation.check_tensor_scale_values(latent, ("scale",))
                self._scales_seen.add(key)
        return latent

    def _accept_planes(self, cache: object) -> LatentKVCache:
        last = self._checked_cache
        if (
            last is not None
            and last[0] is cache
            and last[1] is cache.kv_c
            and last[2] is cache.k_pe
            and last[3] is cache.scale
        ):
            return cast(LatentKVCache, cache)
        checked = check_latent_cache(self.spec, cache, self.backend.device)
        if checked.layout not in self._layouts:
            raise InvalidInputError(
                f"cache layout {checked.layout!r} is not one this backend's MLA kernels read "
                f"({', '.join(self._layouts)})"
            )
        self._checked_cache = (
            checked,
            checked.kv_c,
            checked.k_pe,
            checked.scale,
            checked.num_slots,
            checked.num_blocks,
        )
        return checked

    def _check_meta(self, meta: object, cache: LatentKVCache) -> AttentionMetadata:
        if not isinstance(meta, AttentionMetadata):
            raise InvalidInputError(
                "meta must be what this backend's metadata_builder().build(batch) returns, "
                f"got {type(meta).__name__}"
            )
        extents = meta.extents
        if extents is None:
            raise InvalidInputError(
                f"meta ({type(meta).__name__}) was not made by metadata_builder().build(batch)"
            )
        owner, mine = extents.owner, self.backend
        if owner is not self._owner_ok:
            if type(owner) is not type(mine):
                name = getattr(owner, "name", type(owner).__name__)
                raise InvalidInputError(
                    f"meta was built by the {name!r} backend; this layer's is {mine.name!r}"
                )
            assert owner is not None
            if owner.spec != mine.spec:
                raise InvalidInputError(
                    f"meta was built for another spec ({owner.spec}) than this MLA layer's "
                    f"({mine.spec}): build each layer's steps with a builder of its own spec"
                )
            if not validation.same_device(owner.device, mine.device):
                raise InvalidInputError(
                    f"meta was built for {owner.device}; this layer runs on {mine.device}"
                )
            self._owner_ok = owner
        self.check_call(cache, meta)
        last = self._checked_cache
        assert last is not None and last[0] is cache
        if not (extents.max_slot < last[4] and extents.max_block < last[5]):
            validation.check_extents(extents, meta.batch, cache)
        return meta

    def check_forward(
        self,
        query: object,
        kv_c: object,
        k_pe: object,
        cache: object,
        meta: object,
        output: object,
    ) -> torch.Tensor:
        """Validate a forward call completely (nothing written yet); return the output
        buffer."""
        spec, device = self.spec, self.backend.device
        latent = self._accept_cache(cache)
        step = self._check_meta(meta, latent)
        validation.check_tensor(
            "query", query, (None, spec.num_heads, spec.latent_size), spec.dtype, device
        )
        assert isinstance(query, torch.Tensor)
        if query.stride(-1) != 1:
            raise InvalidInputError(
                f"query's last dimension is strided (strides {query.stride()}): each head's "
                "vector must be dense (stride 1); pass .contiguous()"
            )
        n = step.batch.num_actual_tokens
        if query.shape[0] < n:
            raise InvalidInputError(f"query has {query.shape[0]} tokens, the batch has {n}")
        if (kv_c is None) != (k_pe is None):
            missing = "k_pe (the rope part)" if k_pe is None else "kv_c (the latent)"
            raise InvalidInputError(
                f"{missing} is None: an MLA step writes both kv_c and k_pe, or neither"
            )
        if kv_c is not None:
            check_latent_kv(spec, kv_c, k_pe, device, step.batch.num_tokens)
        shape = (query.shape[0], spec.num_heads, spec.kv_lora_rank)
        if output is None:
            return torch.empty(shape, dtype=spec.dtype, device=device)
        validation.check_tensor("output", output, shape, spec.dtype, device)
        assert isinstance(output, torch.Tensor)
        if output.stride(-1) != 1:
            raise InvalidInputError(
                f"output's last dimension is strided (strides {output.stride()}); pass a "
                "dense buffer"
            )
        return output

    def check_lse(
        self, query: torch.Tensor, lse: torch.Tensor | None, return_lse: bool
    ) -> torch.Tensor:
        """As ``AttentionImpl.check_lse``, for the declared ``capabilities.mla.lse``."""
        if not return_lse:
            raise InvalidInputError("lse= was given without return_lse=True")
        if self._lse_refusal is not None:
            raise UnsupportedConfigurationError(self.backend.name, [self._lse_refusal])
        shape = (query.shape[0], self.spec.num_heads)
        if lse is None:
            return torch.empty(shape, dtype=torch.float32, device=self.backend.device)
        validation.check_tensor("lse", lse, shape, torch.float32, self.backend.device)
        return lse

    def check_call(self, cache: LatentKVCache, meta: AttentionMetadata) -> None:
        """Backend-specific checks of a call with a step's metadata, before anything is
        written (raise InvalidInputError). Default: nothing beyond the shared checks."""
        return None

    # --- public calls ----------------------------------------------------------------------
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank + qk_rope_head_dim]
        kv_c: torch.Tensor | None,  # [num_tokens, kv_lora_rank]; None: nothing new
        k_pe: torch.Tensor | None,  # [num_tokens, qk_rope_head_dim]
        cache: LatentKVCache,
        meta: AttentionMetadata,
        *,
        output: torch.Tensor | None = None,  # [num_tokens, num_heads, kv_lora_rank]
        return_lse: bool = False,
        lse: torch.Tensor | None = None,  # [num_tokens, num_heads] float32
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Write this step's ``(kv_c, k_pe)`` by its slot mapping (unless None), then attend
        for every query token over the latent cache (causal, bottom-right aligned): the
        latent output per head (the engine multiplies it by ``W_UV``). Rows past
        ``num_actual_tokens`` come back as zeros; ``return_lse=True`` returns ``(out, lse)``
        as standard attention's ``forward`` does (where ``capabilities.mla.lse`` declares it).
        """
        out = self.check_forward(query, kv_c, k_pe, cache, meta, output)
        if return_lse or lse is not None:
            lse = self.check_lse(query, lse, return_lse)
        n = meta.batch.num_actual_tokens
        if out.shape[0] > n:
            out[n:].zero_()
        if lse is None:
            self.compute(query, kv_c, k_pe, cache, meta, out)
            return out
        if lse.shape[0] > n:
            lse[n:].fill_(math.inf)
        self.compute(query, kv_c, k_pe, cache, meta, out, lse=lse)
        return out, lse

    def write_kv(
        self,
        kv_c: torch.Tensor,  # [num_tokens, kv_lora_rank]
        k_pe: torch.Tensor,  # [num_tokens, qk_rope_head_dim]
        cache: LatentKVCache,
        slot_mapping: torch.Tensor | None = None,
        *,
        meta: AttentionMetadata | None = None,
    ) -> None:
        """Write latents alone (vLLM's ``do_kv_cache_update``): with ``meta`` the step's slots
        (checked by ``build``), else ``slot_mapping``'s, checked here on the host."""
        latent = self._accept_cache(cache)
        if meta is not None:
            step = self._check_meta(meta, latent)
            given = (step.batch.slot_mapping, step.extents and step.extents.given_slot_mapping)
            if slot_mapping is not None and not any(slot_mapping is t for t in given):
                raise InvalidInputError(
                    "slot_mapping is not meta.batch.slot_mapping: with meta=, leave "
                    "slot_mapping out (or pass the step's own)"
                )
            check_latent_kv(self.spec, kv_c, k_pe, self.backend.device, step.batch.num_tokens)
            self.store_kv(kv_c, k_pe, latent, step.batch.slot_mapping, step)
            return
        if slot_mapping is None:
            raise InvalidInputError("write_kv needs slot_mapping or meta=")
        from attnhub.mla import check_latent_slots

        check_latent_slots(slot_mapping, latent)
        check_latent_kv(self.spec, kv_c, k_pe, self.backend.device, slot_mapping.shape[0])
        self.store_kv(kv_c, k_pe, latent, slot_mapping.contiguous())

    # --- what a backend implements ---------------------------------------------------------
    def compute(
        self,
        query: torch.Tensor,
        kv_c: torch.Tensor | None,
        k_pe: torch.Tensor | None,
        cache: LatentKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank]: rows past the step zeroed
        lse: torch.Tensor | None = None,  # passed only where requested and declared
    ) -> None:
        """A layer's kernel work of one step, after every check. Default: ``store_kv`` then
        ``attend``; a kernel that writes and attends in one call overrides this."""
        if kv_c is not None:
            assert k_pe is not None
            self.store_kv(kv_c, k_pe, cache, meta.batch.slot_mapping, meta)
        if lse is None:
            self.attend(query, cache, meta, out)
        else:
            self.attend(query, cache, meta, out, lse=lse)

    @abc.abstractmethod
    def store_kv(
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        cache: LatentKVCache,
        slot_mapping: torch.Tensor,  # [n] int, -1 = padding (skipped); every slot checked
        meta: AttentionMetadata | None = None,
    ) -> None:
        """Write each token's ``(kv_c, k_pe)`` to its slot (fp8: ``fp8(x / cache.scale)``)."""

    @abc.abstractmethod
    def attend(
        self,
        query: torch.Tensor,
        cache: LatentKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        """Absorbed MLA of every query token of ``meta.batch`` over the latent cache into
        ``out`` (keys ``[kv_c ; k_pe]``, values ``kv_c``, ``spec.scale``, causal bottom-right);
        ``lse`` (natural log) where given."""
