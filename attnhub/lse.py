"""Two partial attentions over disjoint key sets merged into attention over their union, by
their log-sum-exps (a cascade's prefix and suffix calls, a split-KV kernel's parts). Device ops
only (no host read). Reached through :mod:`attnhub.kit`; ``attnhub.reference`` keeps its own
float64 copy on purpose (the oracle is independent of the code it checks).
"""

from __future__ import annotations

import math

import torch


def merge_attn_states(
    a: torch.Tensor,  # [T, H, D]
    a_lse: torch.Tensor,  # [H, T], natural log; an infinite LSE (either sign) = an empty part
    b: torch.Tensor,  # [T, H, D]
    b_lse: torch.Tensor,  # [H, T]
) -> tuple[torch.Tensor, torch.Tensor]:  # merged [T, H, D] float32, lse [H, T] (+inf = empty)
    """m = max(la, lb); w = exp(l - m); out = (wa a + wb b) / (wa + wb) (vLLM's
    ``merge_attn_states``): an empty part weighs 0; both empty give 0 and LSE +inf."""
    la = a_lse.masked_fill(torch.isinf(a_lse), -math.inf)
    lb = b_lse.masked_fill(torch.isinf(b_lse), -math.inf)
    m = torch.maximum(la, lb)
    both_empty = torch.isneginf(m)
    m = m.masked_fill(both_empty, 0.0)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    denom = (wa + wb).masked_fill(both_empty, 1.0)
    merged = (wa.t()[..., None] * a.float() + wb.t()[..., None] * b.float()) / denom.t()[..., None]
    lse = (m + torch.log(denom)).masked_fill(both_empty, math.inf)
    return merged, lse
