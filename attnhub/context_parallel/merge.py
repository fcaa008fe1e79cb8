"""Partial attentions over the ranks' disjoint key shards merged into attention over all keys,
by their natural-log LSEs (vLLM's ``correct_attn_out`` and its all-to-all combine).

Rank ``r`` attended over its shard: output ``o_r`` and ``l_r = log sum_j exp(s_j)`` over its
keys. Over every key, ``L = log sum_r exp(l_r)`` and ``out = sum_r exp(l_r - L) o_r``. A part
whose LSE is infinite (either sign: attnhub's +inf, vLLM's masked -inf) saw no key: it weighs 0
and its output is never read, so a NaN a kernel left there cannot leak. A NaN LSE is not taken
for empty (it is a fault): mask the rows a rank knows to be empty (``mask_empty_rows``) before
they travel. No key anywhere gives output 0 and LSE +inf.

Sinks enter the softmax once: merge the shards without them, then :func:`add_sinks` once on
the merged result (one more term ``exp(sink)`` in the denominator, carrying no value).

Shapes follow ``attnhub.reference``: outputs ``[T, H, D]``, LSEs ``[H, T]``. Results are in
float32 (float64 where an input is), whatever the partials' dtype.
"""

from __future__ import annotations

import math

import torch


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _seen(lses: torch.Tensor) -> torch.Tensor:
    """The LSEs with every empty part (an infinite LSE) at -inf."""
    return lses.masked_fill(torch.isinf(lses), -math.inf)


def global_lse(lses: torch.Tensor) -> torch.Tensor:  # [N, H, T] -> [H, T]
    """``log sum_r exp(l_r)`` over the parts; +inf where no part saw a key."""
    seen = _seen(lses.to(_compute_dtype(lses)))
    total = torch.logsumexp(seen, dim=0)
    return total.masked_fill(torch.isneginf(total), math.inf)


def _weights(lses: torch.Tensor, total: torch.Tensor) -> torch.Tensor:  # [N, H, T]
    """``exp(l_r - L)``: 0 for an empty part (and everywhere when every part is empty)."""
    seen = _seen(lses.to(total.dtype))
    w = torch.exp(seen - total.masked_fill(torch.isinf(total), 0.0))
    return w.masked_fill(torch.isneginf(seen), 0.0)


def correct_partial(
    out: torch.Tensor,  # [T, H, D]: this rank's partial output
    lses: torch.Tensor,  # [N, H, T]: every rank's LSE (all-gathered), this rank's at [rank]
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H, D] exp(l_rank - L) * out, L [H, T]
    """This rank's share of the merged output (vLLM's ``correct_attn_out``): summing the
    shares over the ranks (a reduce-scatter or all-reduce) gives the merged output."""
    total = global_lse(lses)
    w = _weights(lses[rank : rank + 1], total)[0]  # [H, T]
    share = out.to(total.dtype) * w.t()[..., None]
    return share.masked_fill((w == 0).t()[..., None], 0.0), total


def combine_partials(
    outs: torch.Tensor,  # [N, T, H, D]: every part's output
    lses: torch.Tensor,  # [N, H, T]
) -> tuple[torch.Tensor, torch.Tensor]:  # merged [T, H, D], LSE [H, T]
    """All parts merged in one place (the all-to-all variant's last step)."""
    total = global_lse(lses)
    w = _weights(lses, total).transpose(1, 2)[..., None]  # [N, T, H, 1]
    parts = (outs.to(total.dtype) * w).masked_fill(w == 0, 0.0)
    return parts.sum(dim=0), total


def add_sinks(
    out: torch.Tensor,  # [T, H, D]: attention over every key, without sinks
    lse: torch.Tensor,  # [H, T] (+inf: no key)
    sinks: torch.Tensor,  # [H]: one logit per head
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H, D], [H, T]
    """The same attention with each head's sink logit in the softmax denominator:
    ``L' = log(exp(L) + exp(sink))``, ``out' = exp(L - L') out``. Call it once per merged
    result, never per rank."""
    dtype = _compute_dtype(out, lse, sinks)
    seen = _seen(lse.to(dtype))
    sink = sinks.to(dtype)[:, None].expand_as(seen)
    new = torch.logaddexp(seen, sink)
    w = torch.exp(seen - new).masked_fill(torch.isneginf(seen), 0.0)
    scaled = (out.to(dtype) * w.t()[..., None]).masked_fill((w == 0).t()[..., None], 0.0)
    return scaled, new


def mask_empty_rows(lse: torch.Tensor, empty_rows: torch.Tensor) -> torch.Tensor:
    """``lse`` [H, T] with the rows ``empty_rows`` [T] (bool) marks at -inf: parts that saw no
    key, whatever the kernel wrote there (vLLM's ``mask_dcp_empty_shards_``)."""
    if empty_rows.device != lse.device:  # a host mask (eager callers); no copy otherwise
        empty_rows = empty_rows.to(lse.device)
    return lse.masked_fill(empty_rows[None, :], -math.inf)
