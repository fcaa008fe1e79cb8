"""The LSE merge of partial attentions over disjoint key shards, in one process: any split of
the keys, merged, equals attention over all of them (``attnhub.reference``)."""

from __future__ import annotations

import math

import pytest
import torch

from attnhub import reference
from attnhub.context_parallel import (
    add_sinks,
    combine_partials,
    correct_partial,
    global_lse,
    mask_empty_rows,
)
from attnhub.testing import generator

T, H, D, KEYS = 3, 4, 8, 11
SCALE = D**-0.5


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = generator(seed)
    return (
        torch.randn(T, H, D, generator=g, dtype=torch.float64),
        torch.randn(KEYS, 2, D, generator=g, dtype=torch.float64),
        torch.randn(KEYS, 2, D, generator=g, dtype=torch.float64),
    )


def _partials(
    split: list[list[int]], empty_lse: float = math.inf
) -> tuple[torch.Tensor, torch.Tensor]:  # [N, T, H, D], [N, H, T]
    """Each part's attention over its keys (every query row sees every key); a part without
    keys: NaN output (whatever a kernel leaves) and ``empty_lse``."""
    q, k, v = _data()
    outs, lses = [], []
    for keys in split:
        if not keys:
            outs.append(torch.full((T, H, D), math.nan, dtype=torch.float64))
            lses.append(torch.full((H, T), empty_lse, dtype=torch.float64))
            continue
        rows = [reference.attention(q[i : i + 1], k[keys], v[keys], scale=SCALE, causal=False)
                for i in range(T)]  # fmt: skip
        outs.append(torch.cat([o for o, _ in rows]))
        lses.append(torch.cat([lse for _, lse in rows], dim=1))
    return torch.stack(outs), torch.stack(lses)


def _whole(sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = _data()
    rows = [reference.attention(q[i : i + 1], k, v, scale=SCALE, causal=False, sinks=sinks)
            for i in range(T)]  # fmt: skip
    return torch.cat([o for o, _ in rows]), torch.cat([lse for _, lse in rows], dim=1)


SPLITS = {
    "two_halves": [list(range(0, 11, 2)), list(range(1, 11, 2))],
    "uneven_with_an_empty_rank": [[0, 1, 2, 3, 4, 5, 6, 7], [], [8, 9, 10]],
    "one_key_each_and_empties": [[3], [], [0, 1, 2, 4, 5, 6, 7, 8, 9, 10], []],
}


@pytest.mark.parametrize("split", SPLITS.values(), ids=SPLITS.keys())
@pytest.mark.parametrize("empty_lse", [math.inf, -math.inf], ids=["empty+inf", "empty-inf"])
def test_the_corrected_shares_sum_to_attention_over_every_key(
    split: list[list[int]], empty_lse: float
) -> None:
    outs, lses = _partials(split, empty_lse)
    shares = [correct_partial(outs[r], lses, r) for r in range(len(split))]
    merged = sum(share for share, _ in shares)
    want, want_lse = _whole()
    assert isinstance(merged, torch.Tensor)
    torch.testing.assert_close(merged, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(shares[0][1], want_lse, rtol=0, atol=1e-12)


@pytest.mark.parametrize("split", SPLITS.values(), ids=SPLITS.keys())
def test_combining_every_part_in_one_place_is_attention_over_every_key(
    split: list[list[int]],
) -> None:
    outs, lses = _partials(split)
    merged, lse = combine_partials(outs, lses)
    want, want_lse = _whole()
    torch.testing.assert_close(merged, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)


def test_sinks_added_once_to_the_merged_result_equal_the_reference_with_sinks() -> None:
    sinks = torch.randn(H, generator=generator(3), dtype=torch.float64) + 2.0
    merged, lse = combine_partials(*_partials(SPLITS["uneven_with_an_empty_rank"]))
    got, got_lse = add_sinks(merged, lse, sinks)
    want, want_lse = _whole(sinks)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=1e-12)
    # once per rank would count the sink N times: a different result
    twice, _ = add_sinks(got, got_lse, sinks)
    assert (twice - want).abs().max() > 1e-3


def test_no_key_on_any_rank_gives_zero_and_an_infinite_lse() -> None:
    outs, lses = _partials([[], []])
    merged, lse = combine_partials(outs, lses)
    assert torch.equal(merged, torch.zeros_like(merged))
    assert torch.isposinf(lse).all() and torch.isposinf(global_lse(lses)).all()
    share, _ = correct_partial(outs[0], lses, 0)
    assert torch.equal(share, torch.zeros_like(share))


def test_no_key_but_a_sink_gives_zero_and_the_sink_as_lse() -> None:
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    merged, lse = combine_partials(*_partials([[], []]))
    got, got_lse = add_sinks(merged, lse, sinks)
    assert torch.equal(got, torch.zeros_like(got))
    assert torch.equal(got_lse, sinks[:, None].expand(H, T))


def test_a_nan_lse_is_a_fault_not_an_empty_part_unless_masked() -> None:
    outs, lses = _partials(SPLITS["two_halves"])
    lses[1, :, 1] = math.nan  # row 1 of rank 1 went wrong
    merged, _ = combine_partials(outs, lses)
    assert merged[1].isnan().all() and not merged[0].isnan().any()
    empty = torch.tensor([False, True, False])
    masked = torch.stack([lses[0], mask_empty_rows(lses[1], empty)])
    merged, _ = combine_partials(outs, masked)
    assert not merged.isnan().any()


def test_low_precision_partials_merge_in_float32() -> None:
    outs, lses = _partials(SPLITS["two_halves"])
    merged, lse = combine_partials(outs.to(torch.bfloat16), lses.float())
    assert merged.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(merged.double(), _whole()[0], rtol=0, atol=2e-2)
