"""How vLLM's CPU kernels lay out one (block, kv head) of the KV cache, per ISA path.

``cpu_attn_reshape_and_cache`` writes a block's ``block_size`` tokens of ``head_size`` channels
into a dense run of ``block_size * head_size`` elements per plane, ordered by the path:

- "transposed" (vec, vec16; csrc/cpu/cpu_attn_vec*.hpp): keys ``[head_size, block_size]``,
  values ``[block_size, head_size]``. Both are strided views of tokens x channels, so an
  attnhub HND cache *is* that storage (the key plane a transposed view): no packing.
- "amx" (csrc/cpu/cpu_attn_amx.hpp): AMX B tiles of 16 rows x 64 bytes. Keys: groups of 16
  tokens, each group channel pairs (4 bytes) x 16 tokens: ``[block_size / 16, head_size / p,
  16, p]`` with ``p = 4 / element size`` (2 for bf16). Values: groups of 16 channels, each
  token pairs x 16 channels: ``[head_size / 16, block_size / p, 16, p]``. A token or a channel
  is split across two dims that no single stride can join: a :class:`BlockPacking`.

Checked against the op itself (``ops.layout_written``), never assumed: the amx write is plain
stores (no AMX instruction), so it runs, and is checked, on every x86 CPU with AVX512-BF16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnhub.kit import BlockPacking

#: The ISA paths whose blocks attnhub's HND cache views as they are (keys transposed).
TRANSPOSED = "transposed"
AMX = "amx"
#: What each path's write is expected to lay out (ops.layout_written checks it on the op).
EXPECTED = {"vec": TRANSPOSED, "vec16": TRANSPOSED, "amx": AMX}


@dataclass(frozen=True)
class AmxPacking(BlockPacking):
    """vLLM's AMX tile layout of a block (module docstring), for storage planes shaped
    ``[num_blocks, num_kv_heads, block_size, head_size]`` whose last two dims are dense."""

    name: str = "amx"

    @staticmethod
    def _dims(plane: torch.Tensor) -> tuple[int, int, int, int, int]:
        b, h, n, d = plane.shape
        return b, h, n, d, max(1, 4 // plane.element_size())  # elements per 4 bytes

    def unpack(self, storage: torch.Tensor, which: str) -> torch.Tensor:
        b, h, n, d, p = self._dims(storage)
        if which == "key":  # [n/16, d/p, 16, p] -> tokens (n/16, 16), channels (d/p, p)
            tiles = storage.reshape(b, h, n // 16, d // p, 16, p).permute(0, 1, 2, 4, 3, 5)
        else:  # [d/16, n/p, 16, p] -> tokens (n/p, p), channels (d/16, 16)
            tiles = storage.reshape(b, h, d // 16, n // p, 16, p).permute(0, 1, 3, 5, 2, 4)
        return tiles.reshape(b, h, n, d)

    def pack(self, logical: torch.Tensor, which: str, out: torch.Tensor) -> None:
        b, h, n, d, p = self._dims(out)
        if which == "key":
            tiles = logical.reshape(b, h, n // 16, 16, d // p, p).permute(0, 1, 2, 4, 3, 5)
            out.view(b, h, n // 16, d // p, 16, p).copy_(tiles)
        else:
            tiles = logical.reshape(b, h, n // p, p, d // 16, 16).permute(0, 1, 4, 2, 5, 3)
            out.view(b, h, d // 16, n // p, 16, p).copy_(tiles)


AMX_PACKING = AmxPacking()


def storage_of(
    layout: str, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' storage of logical HND planes ``key`` / ``value`` under ``layout``,
    flattened per (block, kv head) to ``[blocks, kv heads, block_size * head_size]``: what
    ``cpu_attn_reshape_and_cache`` on a path of that layout writes."""
    b, h, n, d = key.shape
    if layout == TRANSPOSED:
        return key.transpose(2, 3).reshape(b, h, n * d), value.reshape(b, h, n * d)
    packed_key, packed_value = torch.empty_like(key), torch.empty_like(value)
    AMX_PACKING.pack(key, "key", packed_key)
    AMX_PACKING.pack(value, "value", packed_value)
    return packed_key.reshape(b, h, n * d), packed_value.reshape(b, h, n * d)
