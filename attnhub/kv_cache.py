"""PagedKVCache: the paged key/value storage of one attention layer.

Layouts (named after the order of the last three dims):
  "NHD": key/value [num_blocks, block_size, num_kv_heads, head_size]  (a block's tokens, then heads)
  "HND": key/value [num_blocks, num_kv_heads, block_size, head_size]  (a block's heads, then tokens)
The value plane's last dim is the value head size ``head_size_v`` (``AttentionSpec.head_size_v``;
equal to the key plane's unless a spec says otherwise); every other dim is the key plane's.
A backend declares which one its kernels read (``Capabilities.kv_cache_layout``).
Token position p of a request lives at slot ``block * block_size + offset``.
Scale planes of quantized caches follow ``attnhub.spec.KV_CACHE_DTYPES``:
  "tensor":  a float32 scalar;  "slot": NHD [num_blocks, block_size, num_kv_heads] or
  HND [num_blocks, num_kv_heads, block_size];  "channel": [num_kv_heads, head_size] (the value
  plane's: [num_kv_heads, head_size_v]).

Packed blocks: a backend whose kernels order the elements inside a (block, kv head) in a way no
strided view can show as ``[block_size, head_size]`` (vLLM's AMX kernels interleave tokens and
channels in tile rows) gives its cache a ``packing``: the planes are then that storage, shaped
HND, and ``unpacked()`` / ``edit()`` read and write the logical K/V through the packing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from attnhub.errors import InvalidInputError
from attnhub.quant import indexable
from attnhub.spec import KV_CACHE_DTYPES, AttentionSpec, canonical_kv_cache_dtype

LAYOUTS = ("NHD", "HND")


def _short(value: object) -> str:
    """``repr(value)``, cut to one short line for an error message."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


def _kv_cache_dtype(name: str) -> str:
    """The canonical name of a KV-cache format (aliases such as "fp8" accepted)."""
    canonical = canonical_kv_cache_dtype(name)
    if canonical is None:
        raise InvalidInputError(
            f"kv_cache_dtype = {name!r} is unknown; known: {', '.join(KV_CACHE_DTYPES)}"
        )
    return canonical


#: The shapes a per-tensor ("tensor" kind) scale may have, in a paged KV cache and a latent
#: one alike: one value, ``()`` (what ``allocate`` makes) or ``(1,)``.
TENSOR_SCALE_SHAPES = ((), (1,))


def scale_shape(
    kind: str, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, layout: str
) -> tuple[int, ...] | None:
    """The shape of a scale plane of ``kind`` for a cache of this geometry and layout (the
    plane's own head size), None for "none": what ``allocate`` makes and ``check_cache``
    holds an engine's own scales to ("tensor" takes ``(1,)`` too)."""
    if kind == "none":
        return None
    if kind == "tensor":
        return ()
    if kind == "slot":
        if layout == "NHD":
            return (num_blocks, block_size, num_kv_heads)
        return (num_blocks, num_kv_heads, block_size)
    if kind == "channel":
        return (num_kv_heads, head_size)
    raise InvalidInputError(f"unknown scale kind {kind!r}")


def _scale_plane(
    kind: str,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    layout: str,
    device: torch.device | str,
) -> torch.Tensor | None:
    shape = scale_shape(kind, num_blocks, block_size, num_kv_heads, head_size, layout)
    if shape is None:
        return None
    fill = torch.zeros if kind == "slot" else torch.ones
    return fill(shape, dtype=torch.float32, device=device)


class BlockPacking:
    """How a backend's kernels order the elements of one (block, kv head) of an HND cache, where
    no strided view shows them as ``[block_size, head_size]``. A subclass implements the two
    permutations; instances compare equal when they pack alike (a frozen dataclass does)."""

    name: str = "packed"

    def unpack(self, storage: torch.Tensor, which: str) -> torch.Tensor:
        """The logical plane ``[num_blocks, num_kv_heads, block_size, head_size]`` (a new
        tensor) of ``storage``, the packed ``which`` ("key" or "value") plane."""
        raise NotImplementedError

    def pack(self, logical: torch.Tensor, which: str, out: torch.Tensor) -> None:
        """Write the logical plane ``logical`` into the packed ``which`` plane ``out``."""
        raise NotImplementedError


def same_bytes(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two planes hold the same bytes in the same shape and dtype (NaN-safe; both None
    counts as equal)."""
    if a is None or b is None:
        return a is b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(
        torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    )


@dataclass
class PagedKVCache:
    key: torch.Tensor  # NHD or HND, see module docstring (packed: the kernels' storage)
    value: torch.Tensor
    block_size: int
    layout: str = "NHD"
    kv_cache_dtype: str = "auto"
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None
    #: None: ``key``/``value`` are the logical planes (views in any strides). Else how the
    #: kernels pack each (block, kv head) of HND planes: read through ``unpacked()``.
    packing: BlockPacking | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_dtype", _kv_cache_dtype(self.kv_cache_dtype))
        if self.layout not in LAYOUTS:
            raise InvalidInputError(f"layout = {self.layout!r} is not one of {LAYOUTS}")
        if self.packing is not None and self.layout != "HND":
            raise InvalidInputError(
                f"packed blocks ({self.packing.name}) are HND storage, got layout {self.layout!r}"
            )
        if (
            self.key.dim() != 4
            or self.value.dim() != 4
            or self.key.shape[:3] != self.value.shape[:3]
        ):
            raise InvalidInputError(
                f"key and value caches must be 4-D and alike but for the head size, got "
                f"{tuple(self.key.shape)} and {tuple(self.value.shape)}"
            )
        size_dim = 1 if self.layout == "NHD" else 2
        if self.key.shape[size_dim] != self.block_size:
            raise InvalidInputError(
                f"a {self.layout} cache of shape {tuple(self.key.shape)} does not have "
                f"block_size = {self.block_size} in dim {size_dim}"
            )

    @classmethod
    def allocate(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        *,
        layout: str = "NHD",
        kv_cache_dtype: str = "auto",
        head_size_v: int | None = None,
    ) -> PagedKVCache:
        """Zero-filled planes (scales: ones for static scales, zeros per slot); the value plane
        ``head_size_v`` wide (None: ``head_size``)."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise InvalidInputError(f"num_blocks = {num_blocks!r} must be a positive int")
        if layout not in LAYOUTS:
            raise InvalidInputError(f"layout = {layout!r} is not one of {LAYOUTS}")
        if head_size_v is None:
            head_size_v = head_size
        if isinstance(head_size_v, bool) or not isinstance(head_size_v, int) or head_size_v <= 0:
            raise InvalidInputError(f"head_size_v = {head_size_v!r} must be a positive int")
        kv_cache_dtype = _kv_cache_dtype(kv_cache_dtype)
        fmt = KV_CACHE_DTYPES[kv_cache_dtype]
        kdt, vdt = fmt.storage_dtypes(dtype)
        lead = (
            (num_blocks, block_size, num_kv_heads)
            if layout == "NHD"
            else (num_blocks, num_kv_heads, block_size)
        )
        k_args = (num_blocks, block_size, num_kv_heads, head_size, layout, device)
        v_args = (num_blocks, block_size, num_kv_heads, head_size_v, layout, device)
        return cls(
            key=torch.zeros((*lead, head_size), dtype=kdt, device=device),
            value=torch.zeros((*lead, head_size_v), dtype=vdt, device=device),
            block_size=block_size,
            layout=layout,
            kv_cache_dtype=kv_cache_dtype,
            key_scale=_scale_plane(fmt.key_scale, *k_args),
            value_scale=_scale_plane(fmt.value_scale, *v_args),
        )

    @classmethod
    def for_spec(
        cls, spec: AttentionSpec, num_blocks: int, device: torch.device | str, layout: str = "NHD"
    ) -> PagedKVCache:
        return cls.allocate(
            num_blocks,
            spec.block_size,
            spec.num_kv_heads,
            spec.head_size,
            spec.dtype,
            device,
            layout=layout,
            kv_cache_dtype=spec.kv_cache_dtype,
            head_size_v=spec.head_size_v,
        )

    # --- shape facts -----------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return int(self.key.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.key.shape[2] if self.layout == "NHD" else self.key.shape[1])

    @property
    def head_size(self) -> int:
        return int(self.key.shape[3])

    @property
    def head_size_v(self) -> int:
        """The value plane's head size (``head_size`` unless the spec's values are another)."""
        return int(self.value.shape[3])

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def device(self) -> torch.device:
        return self.key.device

    def planes(self) -> dict[str, torch.Tensor]:
        """Every per-block tensor (those copy/swap move), by name."""
        out = {"key": self.key, "value": self.value}
        fmt = KV_CACHE_DTYPES[self.kv_cache_dtype]
        if fmt.key_scale == "slot" and self.key_scale is not None:
            out["key_scale"] = self.key_scale
        if fmt.value_scale == "slot" and self.value_scale is not None:
            out["value_scale"] = self.value_scale
        return out

    def key_nhd(self) -> torch.Tensor:  # [num_blocks, block_size, num_kv_heads, head_size] view
        self._refuse_packed("key_nhd")
        return self.key if self.layout == "NHD" else self.key.transpose(1, 2)

    def value_nhd(self) -> torch.Tensor:
        self._refuse_packed("value_nhd")
        return self.value if self.layout == "NHD" else self.value.transpose(1, 2)

    def _refuse_packed(self, what: str) -> None:
        if self.packing is not None:
            raise InvalidInputError(
                f"{what}(): this cache's blocks are packed ({self.packing.name}), no view shows "
                "them as tokens x channels: read through cache.unpacked(), write through "
                "cache.edit()"
            )

    # --- packed blocks ---------------------------------------------------------------------
    def unpacked(self) -> PagedKVCache:
        """This cache with logical K/V planes: itself when not packed, else a copy in plain HND
        (the scale planes shared). Read through it; write through :meth:`edit`."""
        if self.packing is None:
            return self
        return replace(
            self,
            key=self.packing.unpack(self.key, "key"),
            value=self.packing.unpack(self.value, "value"),
            packing=None,
        )

    @contextlib.contextmanager
    def edit(self) -> Iterator[PagedKVCache]:
        """A cache with logical K/V planes whose changes land in this one: itself when not
        packed, else :meth:`unpacked`, packed back into this cache's planes on exit."""
        plain = self.unpacked()
        yield plain
        if self.packing is not None:
            self.packing.pack(plain.key, "key", self.key)
            self.packing.pack(plain.value, "value", self.value)

    def slot_scale_nhd(self, which: str) -> torch.Tensor | None:
        """A "slot" scale plane as [num_blocks, block_size, num_kv_heads], else None."""
        kind = getattr(KV_CACHE_DTYPES[self.kv_cache_dtype], which)
        plane = self.key_scale if which == "key_scale" else self.value_scale
        if kind != "slot" or plane is None:
            return None
        return plane if self.layout == "NHD" else plane.transpose(1, 2)

    # --- block operations ------------------------------------------------------------------
    def _check_mapping(
        self, block_mapping: torch.Tensor | Sequence[Sequence[int]], dst_blocks: int
    ) -> torch.Tensor:  # [n, 2] int64 (src, dst) on the host
        if isinstance(block_mapping, torch.Tensor):
            m = block_mapping
            if m.device.type == "meta":
                raise InvalidInputError("block_mapping is a meta tensor: it holds no block ids")
        elif block_mapping is None or isinstance(block_mapping, (str, bytes, Mapping)):
            raise InvalidInputError(
                "block_mapping must be a tensor or a sequence of (src, dst) block pairs, got "
                f"{type(block_mapping).__name__} {_short(block_mapping)}"
            )
        else:
            try:
                m = torch.as_tensor(block_mapping)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise InvalidInputError(
                    f"block_mapping {_short(block_mapping)} is not [n, 2] (src, dst) block ids: "
                    f"{exc}"
                ) from None
        if m.numel() and (m.is_floating_point() or m.is_complex() or m.dtype == torch.bool):
            raise InvalidInputError(f"block_mapping must hold block ids, got dtype {m.dtype}")
        m = m.to("cpu", torch.int64)
        if m.numel() == 0:
            return m.reshape(0, 2)
        if m.dim() != 2 or m.shape[1] != 2:
            raise InvalidInputError(
                f"block_mapping must be [n, 2] (src, dst) pairs, got shape {tuple(m.shape)}"
            )
        for col, name, limit in ((0, "src", self.num_blocks), (1, "dst", dst_blocks)):
            bad = ((m[:, col] < 0) | (m[:, col] >= limit)).nonzero()
            if bad.numel():
                i = int(bad[0, 0])
                raise InvalidInputError(
                    f"block_mapping[{i}] {name} block {int(m[i, col])} is outside the cache "
                    f"({limit} blocks)"
                )
        dst = m[:, 1].tolist()
        if len(set(dst)) != len(dst):  # which copy lands would be up to the device
            seen: dict[int, int] = {}
            for j, block in enumerate(dst):
                if block in seen:
                    raise InvalidInputError(
                        f"block_mapping[{seen[block]}] and block_mapping[{j}] both copy to dst "
                        f"block {block}"
                    )
                seen[block] = j
        return m

    def copy_blocks(self, block_mapping: torch.Tensor | Sequence[Sequence[int]]) -> None:
        """Copy whole blocks within this cache (copy-on-write of a shared prefix).

        The mapping is checked first (InvalidInputError naming what is wrong: not pairs of
        block ids, or a block outside the cache); all sources are read before any destination
        is written.
        """
        m = self._check_mapping(block_mapping, self.num_blocks)
        if not m.numel():
            return
        src, dst = m[:, 0].to(self.device), m[:, 1].to(self.device)
        for plane in self.planes().values():
            plane = indexable(plane)
            plane.index_copy_(0, dst, plane.index_select(0, src))

    def swap_blocks(
        self, dst: PagedKVCache, block_mapping: torch.Tensor | Sequence[Sequence[int]]
    ) -> None:
        """Copy blocks ``self[src] -> dst[dst]``, e.g. between device and host caches.

        Every argument is checked before any block moves (InvalidInputError naming it)."""
        if not isinstance(dst, PagedKVCache):
            raise InvalidInputError(
                f"swap_blocks' dst must be a PagedKVCache, got {type(dst).__name__} {_short(dst)}"
            )
        mine = (self.layout, self.kv_cache_dtype, self.key.dtype, self.value.dtype)
        theirs = (dst.layout, dst.kv_cache_dtype, dst.key.dtype, dst.value.dtype)
        if (
            mine != theirs
            or dst.key.shape[1:] != self.key.shape[1:]
            or dst.value.shape[1:] != self.value.shape[1:]
        ):
            raise InvalidInputError(
                "swap_blocks needs caches of the same layout, dtype and block shape: "
                f"{self.layout}/{self.kv_cache_dtype}/{self.key.dtype}/"
                f"{tuple(self.key.shape[1:])}/{tuple(self.value.shape[1:])} vs {dst.layout}/"
                f"{dst.kv_cache_dtype}/{dst.key.dtype}/{tuple(dst.key.shape[1:])}/"
                f"{tuple(dst.value.shape[1:])}"
            )
        if self.packing != dst.packing:
            raise InvalidInputError(
                "swap_blocks needs caches whose blocks are packed alike: "
                f"{_packing_name(self)} vs {_packing_name(dst)}"
            )
        dst_planes = dst.planes()
        for name, plane in self.planes().items():
            other = dst_planes.get(name)
            if other is None or other.shape[1:] != plane.shape[1:] or other.dtype != plane.dtype:
                got = "none" if other is None else f"{other.dtype} {tuple(other.shape[1:])}"
                raise InvalidInputError(
                    f"swap_blocks: dst.{name} per block is {got}, this cache's is "
                    f"{plane.dtype} {tuple(plane.shape[1:])}"
                )
        for name in ("key_scale", "value_scale"):  # static scales: not moved, so equal
            mine_scale, their_scale = getattr(self, name), getattr(dst, name)
            if name in dst_planes or (mine_scale is None and their_scale is None):
                continue
            if (
                mine_scale is None
                or their_scale is None
                or not torch.equal(mine_scale.cpu(), their_scale.cpu())
            ):
                raise InvalidInputError(
                    f"swap_blocks: dst.{name} is {_short(their_scale)}, this cache's is "
                    f"{_short(mine_scale)}: the moved bytes would read back as other values "
                    "under another static scale (make the swap space with cache.empty_like)"
                )
        m = self._check_mapping(block_mapping, dst.num_blocks)
        if not m.numel():
            return
        for name, plane in self.planes().items():
            moved = indexable(plane).index_select(0, m[:, 0].to(plane.device)).to(dst.device)
            indexable(dst_planes[name]).index_copy_(0, m[:, 1].to(dst.device), moved)

    def empty_like(
        self, num_blocks: int | None = None, device: torch.device | str | None = None
    ) -> PagedKVCache:
        """A zeroed cache of the same format (static scales copied), e.g. a host swap space."""
        n = self.num_blocks if num_blocks is None else num_blocks
        dev = self.device if device is None else torch.device(device)

        def fresh(t: torch.Tensor | None, per_block: bool) -> torch.Tensor | None:
            if t is None:
                return None
            if per_block:
                return torch.zeros((n, *t.shape[1:]), dtype=t.dtype, device=dev)
            return t.detach().clone().to(dev)

        fmt = KV_CACHE_DTYPES[self.kv_cache_dtype]
        key, value = fresh(self.key, True), fresh(self.value, True)
        assert key is not None and value is not None
        return replace(
            self,
            key=key,
            value=value,
            key_scale=fresh(self.key_scale, fmt.key_scale == "slot"),
            value_scale=fresh(self.value_scale, fmt.value_scale == "slot"),
        )

    def clone(self) -> PagedKVCache:
        """A deep copy (tests compare caches byte for byte before and after a call)."""
        return replace(
            self,
            key=self.key.clone(),
            value=self.value.clone(),
            key_scale=None if self.key_scale is None else self.key_scale.clone(),
            value_scale=None if self.value_scale is None else self.value_scale.clone(),
        )

    def equal(self, other: PagedKVCache) -> bool:
        """Byte-for-byte equality of every plane (NaN-safe)."""

        return (
            self.packing == other.packing
            and same_bytes(self.key, other.key)
            and same_bytes(self.value, other.value)
            and same_bytes(self.key_scale, other.key_scale)
            and same_bytes(self.value_scale, other.value_scale)
        )


def _packing_name(cache: PagedKVCache) -> str:
    return "not packed" if cache.packing is None else f"packed {cache.packing.name}"
