"""MLA (multi-head latent attention, DeepSeek-V2/V3): one layer's spec, its latent paged cache
and the KV write of ``(kv_c, k_pe)`` by slot mapping.

Per token the engine caches one latent vector ``kv_c`` (``kv_lora_rank`` wide, 512 in
DeepSeek) and a rotary key part ``k_pe`` (``qk_rope_head_dim``, 64), shared by every head: no
kv heads. Attention over it has two forms that give the same result (``attnhub.reference``
computes both):

- absorbed (decode): per head ``q = [q_nope @ W_UK ; q_pe]`` (``kv_lora_rank + rope`` wide),
  multi-query attention over keys ``[kv_c ; k_pe]`` and values ``kv_c``; the output per head is
  in latent space (``kv_lora_rank``), which the engine multiplies by ``W_UV``.
- expanded (prefill): per head keys ``[kv_c @ W_UK ; k_pe]`` (``qk_nope + rope``) and values
  ``kv_c @ W_UV`` (``v_head_dim``): ordinary attention whose value head size differs from the
  key head size.

Weights follow vLLM's shapes: ``W_UK`` [kv_lora_rank, num_heads, qk_nope_head_dim], ``W_UV``
[kv_lora_rank, num_heads, v_head_dim] (``kv_b_proj`` split per head).

Scale: both forms use the expanded form's ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``
(or the spec's ``scale``), never ``(kv_lora_rank + rope) ** -0.5``: the absorbed scores
``(q_nope @ W_UK) . kv_c + q_pe . k_pe`` are the same numbers as the expanded
``q_nope . (kv_c @ W_UK) + q_pe . k_pe``, so they take the same scale.

Cache layouts (``LatentKVCache.layout``), slot ``s`` = block ``s // block_size``, offset
``s % block_size``:
  "joint": one plane [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], a token's
           ``kv_c`` then its ``k_pe`` (vLLM's MLA cache, ``concat_and_cache_mla``); ``kv_c``
           and ``k_pe`` are the two views of it.
  "split": two planes, ``kv_c`` [num_blocks, block_size, kv_lora_rank] and ``k_pe``
           [num_blocks, block_size, qk_rope_head_dim] (vendors that keep the nope and rope
           parts apart).
fp8 (``kv_cache_dtype`` "fp8_e4m3", alias "fp8", or "fp8_e5m2"): both parts, the rope part
too, stored ``fp8(x / scale)`` with one per-tensor float32 ``scale`` for the whole entry, as
vLLM's ``concat_and_cache_mla`` writes them with the layer's ``_k_scale`` (its kernel applies
``fp8::scaled_convert(x, *scale)`` to ``kv_c`` and to ``k_pe``): ``x`` widened to float32,
divided by the scale in float32, rounded to the nearest fp8 value (ties to even) and saturated
at the format's largest finite value (``__NV_SATFINITE``: +-448 for e4m3, +-57344 for e5m2;
NaN stays NaN). Read back as vLLM's kernels read it (:func:`dequantize_latent`): ``fp8 * scale``
in float32, rounded to the model dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from attnhub import validation
from attnhub.errors import InvalidInputError, InvalidSpecError
from attnhub.kv_cache import TENSOR_SCALE_SHAPES, same_bytes
from attnhub.kv_write import flat_slots, read_slots, write_slots
from attnhub.quant import indexable, quantize_fp8
from attnhub.spec import KV_CACHE_DTYPES, MODEL_DTYPES, KVCacheDType, canonical_kv_cache_dtype

__all__ = [
    "LATENT_KV_CACHE_DTYPES",
    "LATENT_LAYOUTS",
    "LatentKVCache",
    "MLASpec",
    "check_latent_cache",
    "check_latent_kv",
    "check_latent_slots",
    "dequantize_latent",
    "read_latent_rows",
    "store_latent_rows",
    "write_latent_kv",
]

LATENT_LAYOUTS = ("joint", "split")

#: The KV-cache formats a latent cache can hold (names of ``attnhub.spec.KV_CACHE_DTYPES``):
#: the model dtype, or fp8 (e4m3 or e5m2) with one per-tensor scale for the whole entry, the
#: formats vLLM's ``concat_and_cache_mla`` writes (its ``DISPATCH_BY_KV_CACHE_DTYPE``: "fp8" /
#: "fp8_e4m3" and "fp8_e5m2"; vLLM 0.32's CUTLASS_MLA, FLASHINFER_MLA, FLASHMLA and TRITON_MLA
#: declare "fp8" / "fp8_e4m3", ROCM_AITER_MLA "fp8_e5m2" too, CPU_MLA "auto" only). The int8
#: rows scale per kv head (a latent cache has none) or per value channel (the latent is no
#: value until ``W_UV``), so they have no latent form. FlashMLA's sparse "fp8_ds_mla" entry
#: (656 bytes: per-tile scales, a bf16 rope part) is another layout, not one of these.
LATENT_KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")


def _short(value: object) -> str:
    """``repr(value)`` cut to one short line (for errors)."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidSpecError(f"{name} = {value!r} must be a positive int")


def _latent_kv_cache_dtype(name: object, error: type[Exception]) -> str:
    """The canonical name of a latent cache format, else ``error`` naming ``name``."""
    kv = canonical_kv_cache_dtype(name)
    if kv is None:
        raise error(f"kv_cache_dtype = {name!r} is unknown; known: {', '.join(KV_CACHE_DTYPES)}")
    if kv not in LATENT_KV_CACHE_DTYPES:
        raise error(
            f"kv_cache_dtype = {name!r} has no latent-cache form (a latent cache stores "
            f"{', '.join(LATENT_KV_CACHE_DTYPES)})"
        )
    return kv


@dataclass(frozen=True)
class MLASpec:
    """One MLA layer's configuration. Immutable and validated on construction
    (:class:`~attnhub.errors.InvalidSpecError` naming the bad value).

    ``scale`` is the softmax scale of both forms (None or left out:
    ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, the expanded form's; a model with YaRN
    scaling passes its own). ``kv_cache_dtype`` becomes its canonical name (``"fp8"`` ->
    ``"fp8_e4m3"``). MLA layers are causal decoder self-attention.
    """

    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    scale: float = None  # type: ignore[assignment]  # None: (qk_nope + qk_rope) ** -0.5

    def __post_init__(self) -> None:
        for name in (
            "num_heads",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
            "block_size",
        ):
            _positive_int(name, getattr(self, name))
        if self.dtype not in MODEL_DTYPES:
            raise InvalidSpecError(
                f"dtype = {self.dtype!r} is not a model dtype (one of float32, float16, bfloat16)"
            )
        kv = _latent_kv_cache_dtype(self.kv_cache_dtype, InvalidSpecError)
        object.__setattr__(self, "kv_cache_dtype", kv)
        scale = self.qk_head_dim**-0.5 if self.scale is None else self.scale
        if (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float))
            or not 0 < scale < math.inf
        ):
            raise InvalidSpecError(f"scale = {self.scale!r} must be a positive finite float")
        object.__setattr__(self, "scale", float(scale))

    # --- derived facts ---------------------------------------------------------------------
    @property
    def causal(self) -> bool:
        return True

    @property
    def qk_head_dim(self) -> int:
        """The expanded form's query/key head size, ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_size(self) -> int:
        """One cached entry, ``kv_lora_rank + qk_rope_head_dim``: the absorbed form's
        query/key head size (576 in DeepSeek; vLLM's MLA ``head_size``)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kv_cache_format(self) -> KVCacheDType:
        return KV_CACHE_DTYPES[self.kv_cache_dtype]

    @property
    def cache_storage_dtype(self) -> torch.dtype:
        """The dtype of the latent cache's planes."""
        return self.kv_cache_format.key_dtype or self.dtype


def _storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return KV_CACHE_DTYPES[kv_cache_dtype].key_dtype or model_dtype


@dataclass
class LatentKVCache:
    """The paged latent cache of one MLA layer (layouts: see the module docstring).

    ``kv_c`` [num_blocks, block_size, kv_lora_rank] and ``k_pe`` [num_blocks, block_size,
    qk_rope_head_dim]: for layout "joint" the two views of one plane (:attr:`joint`), for
    "split" two planes. ``scale``: fp8's float32 scalar (one for both parts; shape ``()`` or
    ``(1,)``), else None.
    """

    kv_c: torch.Tensor
    k_pe: torch.Tensor
    block_size: int
    layout: str = "joint"
    kv_cache_dtype: str = "auto"
    scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the cache's own invariants (InvalidInputError naming what is wrong): run at
        construction and again by :func:`check_latent_cache` where the planes or the scale
        were replaced since (an engine attaching its own scale tensor)."""
        kv = _latent_kv_cache_dtype(self.kv_cache_dtype, InvalidInputError)
        object.__setattr__(self, "kv_cache_dtype", kv)
        if self.layout not in LATENT_LAYOUTS:
            raise InvalidInputError(f"layout = {self.layout!r} is not one of {LATENT_LAYOUTS}")
        for name in ("kv_c", "k_pe"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise InvalidInputError(
                    f"cache {name} must be a 3-D tensor [num_blocks, block_size, width], got {got}"
                )
        validation.check_planes_written_in_place(self, ("kv_c", "k_pe"))
        kv_c, k_pe = self.kv_c, self.k_pe
        if kv_c.shape[:2] != k_pe.shape[:2] or kv_c.shape[1] != self.block_size:
            raise InvalidInputError(
                f"cache kv_c {list(kv_c.shape)} and k_pe {list(k_pe.shape)} must both be "
                f"[num_blocks, block_size = {self.block_size}, width]"
            )
        if kv_c.dtype != k_pe.dtype or kv_c.device != k_pe.device:
            raise InvalidInputError(
                f"cache kv_c ({kv_c.dtype} on {kv_c.device}) and k_pe ({k_pe.dtype} on "
                f"{k_pe.device}) must share dtype and device"
            )
        fmt = KV_CACHE_DTYPES[kv]
        if fmt.key_dtype is not None and kv_c.dtype != fmt.key_dtype:
            raise InvalidInputError(
                f"kv_cache_dtype {kv!r} stores {fmt.key_dtype}, the cache planes are {kv_c.dtype}"
            )
        if fmt.key_dtype is None and kv_c.dtype not in MODEL_DTYPES:
            raise InvalidInputError(
                f"kv_cache_dtype 'auto' stores the model dtype, the cache planes are {kv_c.dtype}"
            )
        if fmt.key_scale == "tensor":
            s = self.scale
            if (
                not isinstance(s, torch.Tensor)
                or s.shape not in TENSOR_SCALE_SHAPES
                or s.dtype != torch.float32
            ):
                raise InvalidInputError(
                    f"kv_cache_dtype {kv!r} needs scale, a float32 scalar tensor (shape () or "
                    f"(1,), as a paged KV cache's per-tensor scale); got {_short(s)}"
                )
            if not validation.same_device(s.device, kv_c.device):
                raise InvalidInputError(
                    f"cache scale is on {s.device}, the planes on {kv_c.device}"
                )
        elif self.scale is not None:
            raise InvalidInputError(f"kv_cache_dtype {kv!r} has no scale; got {self.scale!r}")
        if self.layout == "joint":
            self._check_joint()

    def _check_joint(self) -> None:
        """``k_pe`` continues ``kv_c`` in each row of one plane."""
        kv_c, k_pe = self.kv_c, self.k_pe
        width = kv_c.shape[2]
        one_plane = (
            kv_c.untyped_storage().data_ptr() == k_pe.untyped_storage().data_ptr()
            and kv_c.stride() == k_pe.stride()
            and (kv_c.stride(2) == 1 or width == 1)
            and (k_pe.stride(2) == 1 or k_pe.shape[2] == 1)
            and k_pe.storage_offset() == kv_c.storage_offset() + width
            and kv_c.stride(1) >= width + k_pe.shape[2]
        )
        if not one_plane:
            raise InvalidInputError(
                "a 'joint' latent cache's kv_c and k_pe must be the two parts of each row of one "
                f"plane (strides {kv_c.stride()} / {k_pe.stride()}, offsets "
                f"{kv_c.storage_offset()} / {k_pe.storage_offset()}): build it with "
                "LatentKVCache.from_joint(plane, kv_lora_rank), or use layout 'split'"
            )

    # --- construction ----------------------------------------------------------------------
    @classmethod
    def from_joint(
        cls,
        plane: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
        kv_lora_rank: int,
        *,
        kv_cache_dtype: str = "auto",
        scale: torch.Tensor | None = None,
    ) -> LatentKVCache:
        """A "joint" cache over an engine's own plane (no copy: vLLM's MLA ``kv_cache``)."""
        if not isinstance(plane, torch.Tensor) or plane.dim() != 3:
            got = list(plane.shape) if isinstance(plane, torch.Tensor) else type(plane).__name__
            raise InvalidInputError(
                f"a joint latent plane is [num_blocks, block_size, kv_lora_rank + rope], got {got}"
            )
        if (
            isinstance(kv_lora_rank, bool)
            or not isinstance(kv_lora_rank, int)
            or not 0 < kv_lora_rank < plane.shape[2]
        ):
            raise InvalidInputError(
                f"kv_lora_rank = {kv_lora_rank!r} must leave a rope part in a plane "
                f"{plane.shape[2]} wide"
            )
        return cls(
            kv_c=plane[..., :kv_lora_rank],
            k_pe=plane[..., kv_lora_rank:],
            block_size=int(plane.shape[1]),
            layout="joint",
            kv_cache_dtype=kv_cache_dtype,
            scale=scale,
        )

    @classmethod
    def allocate(
        cls,
        num_blocks: int,
        block_size: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        *,
        layout: str = "joint",
        kv_cache_dtype: str = "auto",
    ) -> LatentKVCache:
        """Zero-filled planes (fp8: scale 1.0, set by the engine)."""
        for name, value in (
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("kv_lora_rank", kv_lora_rank),
            ("qk_rope_head_dim", qk_rope_head_dim),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidInputError(f"{name} = {value!r} must be a positive int")
        if layout not in LATENT_LAYOUTS:
            raise InvalidInputError(f"layout = {layout!r} is not one of {LATENT_LAYOUTS}")
        kv = _latent_kv_cache_dtype(kv_cache_dtype, InvalidInputError)
        storage = _storage_dtype(kv, dtype)
        scale = (
            torch.ones((), dtype=torch.float32, device=device)
            if KV_CACHE_DTYPES[kv].key_scale == "tensor"
            else None
        )
        if layout == "joint":
            plane = torch.zeros(
                (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim),
                dtype=storage,
                device=device,
            )
            return cls.from_joint(plane, kv_lora_rank, kv_cache_dtype=kv, scale=scale)
        return cls(
            kv_c=torch.zeros((num_blocks, block_size, kv_lora_rank), dtype=storage, device=device),
            k_pe=torch.zeros(
                (num_blocks, block_size, qk_rope_head_dim), dtype=storage, device=device
            ),
            block_size=block_size,
            layout="split",
            kv_cache_dtype=kv,
            scale=scale,
        )

    @classmethod
    def for_spec(
        cls,
        spec: MLASpec,
        num_blocks: int,
        device: torch.device | str = "cpu",
        layout: str = "joint",
    ) -> LatentKVCache:
        return cls.allocate(
            num_blocks,
            spec.block_size,
            spec.kv_lora_rank,
            spec.qk_rope_head_dim,
            spec.dtype,
            device,
            layout=layout,
            kv_cache_dtype=spec.kv_cache_dtype,
        )

    # --- shape facts -----------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return int(self.kv_c.shape[0])

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_lora_rank(self) -> int:
        return int(self.kv_c.shape[2])

    @property
    def qk_rope_head_dim(self) -> int:
        return int(self.k_pe.shape[2])

    @property
    def device(self) -> torch.device:
        return self.kv_c.device

    @property
    def joint(self) -> torch.Tensor:  # [num_blocks, block_size, kv_lora_rank + rope]
        """The one plane of a "joint" cache (a view: what vLLM's MLA kernels read)."""
        if self.layout != "joint":
            raise InvalidInputError(
                f"a {self.layout!r} latent cache has no joint plane; read kv_c and k_pe"
            )
        kv_c = self.kv_c
        shape = (*kv_c.shape[:2], self.kv_lora_rank + self.qk_rope_head_dim)
        return kv_c.as_strided(shape, (kv_c.stride(0), kv_c.stride(1), 1))

    def planes(self) -> dict[str, torch.Tensor]:
        """Every per-block tensor, by name ("joint" one, "split" two)."""
        if self.layout == "joint":
            return {"joint": self.joint}
        return {"kv_c": self.kv_c, "k_pe": self.k_pe}

    # --- copies and comparisons -------------------------------------------------------------
    def clone(self) -> LatentKVCache:
        """A deep copy in the same layout (tests compare caches byte for byte)."""
        scale = None if self.scale is None else self.scale.clone()
        if self.layout == "joint":
            return LatentKVCache.from_joint(
                self.joint.clone(),
                self.kv_lora_rank,
                kv_cache_dtype=self.kv_cache_dtype,
                scale=scale,
            )
        return replace(self, kv_c=self.kv_c.clone(), k_pe=self.k_pe.clone(), scale=scale)

    def equal(self, other: LatentKVCache) -> bool:
        """Byte-for-byte equality of every part and the scale (NaN-safe)."""

        return (
            self.layout == other.layout
            and self.kv_cache_dtype == other.kv_cache_dtype
            and same_bytes(self.kv_c, other.kv_c)
            and same_bytes(self.k_pe, other.k_pe)
            and same_bytes(self.scale, other.scale)
        )


# --- checks ---------------------------------------------------------------------------------


def check_latent_cache(spec: MLASpec, cache: object, device: torch.device | str) -> LatentKVCache:
    """``cache`` is a latent cache of ``spec``'s geometry, format and model dtype on ``device``
    (:class:`~attnhub.errors.InvalidInputError` naming what differs)."""
    if not isinstance(cache, LatentKVCache):
        raise InvalidInputError(f"cache must be a LatentKVCache, got {type(cache).__name__}")
    cache.validate()  # its planes or its scale may have been replaced since construction
    if cache.kv_cache_dtype != spec.kv_cache_dtype:
        raise InvalidInputError(
            f"cache kv_cache_dtype is {cache.kv_cache_dtype!r}, the spec says "
            f"{spec.kv_cache_dtype!r}"
        )
    if cache.block_size != spec.block_size:
        raise InvalidInputError(
            f"cache block_size is {cache.block_size}, the spec says {spec.block_size}"
        )
    widths = (cache.kv_lora_rank, cache.qk_rope_head_dim)
    if widths != (spec.kv_lora_rank, spec.qk_rope_head_dim):
        raise InvalidInputError(
            f"cache holds latents of (kv_lora_rank, qk_rope_head_dim) = {widths}, the spec says "
            f"{(spec.kv_lora_rank, spec.qk_rope_head_dim)}"
        )
    if cache.kv_c.dtype != spec.cache_storage_dtype:
        raise InvalidInputError(
            f"cache stores {cache.kv_c.dtype}, kv_cache_dtype {spec.kv_cache_dtype!r} of a "
            f"{spec.dtype} model needs {spec.cache_storage_dtype}"
        )
    if not validation.same_device(cache.device, torch.device(device)):
        raise InvalidInputError(f"cache is on {cache.device}, expected {device}")
    return cache


def check_latent_kv(
    spec: MLASpec, kv_c: object, k_pe: object, device: torch.device | str, num_slots: int
) -> None:
    """New latents: ``kv_c`` [n >= num_slots, kv_lora_rank] and ``k_pe`` [n, qk_rope_head_dim]
    in the model dtype on ``device``, each row dense (stride 1)."""
    dev = torch.device(device)
    widths = (("kv_c", kv_c, spec.kv_lora_rank), ("k_pe", k_pe, spec.qk_rope_head_dim))
    for name, t, width in widths:
        if t is None:
            raise InvalidInputError(
                f"{name} is None: an MLA write needs both the latent kv_c and the rope part k_pe"
            )
        validation.check_tensor(name, t, (None, width), spec.dtype, dev)
        assert isinstance(t, torch.Tensor)
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise InvalidInputError(
                f"{name}'s last dimension is strided (strides {t.stride()}): each row must be "
                "dense (stride 1); pass .contiguous()"
            )
    assert isinstance(kv_c, torch.Tensor) and isinstance(k_pe, torch.Tensor)
    if kv_c.shape[0] != k_pe.shape[0]:
        raise InvalidInputError(f"kv_c has {kv_c.shape[0]} tokens but k_pe has {k_pe.shape[0]}")
    if kv_c.shape[0] < num_slots:
        raise InvalidInputError(
            f"kv_c has {kv_c.shape[0]} tokens but slot_mapping has {num_slots} entries"
        )


def check_latent_slots(slot_mapping: object, cache: LatentKVCache) -> torch.Tensor:
    """A 1-D int32/int64 slot mapping on the cache's device whose every entry is -1 (padding)
    or a slot of ``cache``, no two equal (the rules of a PagedKVCache write)."""
    validation.check_tensor(
        "slot_mapping", slot_mapping, (None,), (torch.int32, torch.int64), cache.device
    )
    assert isinstance(slot_mapping, torch.Tensor)
    if slot_mapping.numel():
        slots = slot_mapping.to("cpu").numpy().astype(np.int64)
        validation.GIVEN_SLOTS.check(slots, cache)
    return slot_mapping


# --- the write --------------------------------------------------------------------------------


def write_latent_kv(
    spec: MLASpec,
    cache: LatentKVCache,
    kv_c: torch.Tensor,  # [num_tokens, kv_lora_rank]
    k_pe: torch.Tensor,  # [num_tokens, qk_rope_head_dim]
    slot_mapping: torch.Tensor,  # [n <= num_tokens] int, -1 = padding (skipped)
) -> None:
    """Write each token's ``(kv_c, k_pe)`` to its slot (fp8: quantized with the cache's scale).

    Everything is checked first (InvalidInputError naming the bad value): a refused write
    leaves the cache byte-identical. Slot values are read on the host (a copy where they live
    on an accelerator)."""
    check_latent_cache(spec, cache, cache.device)
    slot_mapping = check_latent_slots(slot_mapping, cache)
    check_latent_kv(spec, kv_c, k_pe, cache.device, slot_mapping.shape[0])
    slots = slot_mapping.long()
    keep = slots >= 0
    rows = keep.nonzero()[:, 0]
    if not rows.numel():
        return
    store_latent_rows(
        cache, kv_c.index_select(0, rows), k_pe.index_select(0, rows), slots.index_select(0, rows)
    )


def dequantize_latent(
    raw: torch.Tensor,  # a gathered part of a latent cache, in its storage dtype
    scale: torch.Tensor | None,  # the cache's float32 scale (None: not quantized)
    dtype: torch.dtype,  # the model dtype
) -> torch.Tensor:  # float32, the same shape
    """Latents as vLLM's kernels read them, in float32: fp8 ``(fp8 * scale)`` computed in float32
    and rounded to the model dtype, as TRITON_MLA's decode kernel does (``(k.to(tl.float32) *
    ks).to(q.dtype)`` for ``kv_c`` and ``k_pe`` alike) and as ``gather_and_maybe_dequant_cache``
    does for the context of vLLM's expanded prefill; a model-dtype cache as stored."""
    if scale is None:
        return raw.float()
    return (raw.float() * scale).to(dtype).float()


def read_latent_rows(
    cache: LatentKVCache,
    slots: torch.Tensor,  # [n] int64, every slot in the cache (the caller's plan)
    dtype: torch.dtype,  # the model dtype
) -> tuple[torch.Tensor, torch.Tensor]:  # kv_c [n, kv_lora_rank], k_pe [n, rope] in ``dtype``
    """What the cache holds at ``slots`` (the read :func:`store_latent_rows` mirrors), in either
    layout (the joint plane's rows split, or the two planes), as vLLM's kernels read it: fp8
    dequantized with the cache's scale as :func:`dequantize_latent` does (``fp8 * scale`` in
    float32, rounded to ``dtype``: ``gather_and_maybe_dequant_cache``, which gathers the cached
    context of vLLM's expanded prefill). Device ops only (no host read)."""
    stored = cache.kv_c.dtype

    def read(plane: torch.Tensor) -> torch.Tensor:  # fp8 read as bytes (no CPU index kernels)
        raw = indexable(plane)
        return read_slots(raw, flat_slots(raw), slots).view(stored)

    if cache.layout == "joint":
        rows = read(cache.joint)  # [n, kv_lora_rank + rope]
        parts = rows.split([cache.kv_lora_rank, cache.qk_rope_head_dim], dim=-1)
    else:
        parts = (read(cache.kv_c), read(cache.k_pe))
    if cache.scale is None:
        return parts[0].to(dtype), parts[1].to(dtype)
    kv_c, k_pe = (dequantize_latent(p, cache.scale, dtype).to(dtype) for p in parts)
    return kv_c, k_pe


def store_latent_rows(
    cache: LatentKVCache,
    new_c: torch.Tensor,  # [n, kv_lora_rank] in the model dtype
    new_pe: torch.Tensor,  # [n, qk_rope_head_dim]
    slots: torch.Tensor,  # [n] int64, every slot in the cache and distinct (checked before)
) -> None:
    """The write itself, nothing checked: each row to its slot, fp8 quantized with the
    cache's scale (backends call it after the step's checks)."""
    if cache.scale is not None:  # fp8: one per-tensor scale for the whole entry
        new_c = quantize_fp8(new_c, cache.scale, cache.kv_c.dtype)
        new_pe = quantize_fp8(new_pe, cache.scale, cache.kv_c.dtype)
    if cache.layout == "joint":
        plane = indexable(cache.joint)
        row = torch.cat([indexable(new_c), indexable(new_pe)], dim=1)
        write_slots(plane, flat_slots(plane), slots, row)
        return
    for plane, new in ((cache.kv_c, new_c), (cache.k_pe, new_pe)):
        plane = indexable(plane)
        write_slots(plane, flat_slots(plane), slots, indexable(new))
