"""The float64 reference reproduces the golden convention cases (computed independently).

The cases live in the repo, ``tests/data/attention_conventions.json`` (a copy of the project's
``golden/attention_conventions.json``), so a fresh clone checks them; a missing file is a
failure, never a skip.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnhub import reference

CONVENTIONS = Path(__file__).resolve().parent / "data" / "attention_conventions.json"
ATOL = 1e-9


def _load() -> dict:
    if not CONVENTIONS.is_file():
        raise FileNotFoundError(
            f"golden data missing: {CONVENTIONS} is part of the repo (git checkout -- tests/data)"
        )
    return json.loads(CONVENTIONS.read_text())


GOLD = _load()


def t64(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def window_of(case: dict) -> tuple[int, int]:
    w = case["sliding_window"]
    if w is None:
        return (-1, -1)
    return (w - 1, 0) if case["causal"] else (w - 1, w - 1)


def run_case(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    slopes, sinks = case["alibi_slopes"], case["sinks"]
    return reference.attention(
        t64(case["query"]),
        t64(case["key"]),
        t64(case["value"]),
        scale=case["scale"],
        causal=case["causal"],
        window=window_of(case),
        logits_soft_cap=case["logits_soft_cap"],
        alibi_slopes=None if slopes is None else t64(slopes),
        sinks=None if sinks is None else t64(sinks),
    )


@pytest.mark.parametrize("case", GOLD["cases"], ids=lambda c: c["name"])
def test_reference_attention_reproduces_golden_output(case: dict) -> None:
    out, _ = run_case(case)
    expected = t64(case["expected_output"])
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0, msg=case["convention"])


@pytest.mark.parametrize("case", GOLD["cases"], ids=lambda c: c["name"])
def test_reference_attention_reproduces_golden_lse(case: dict) -> None:
    _, lse = run_case(case)
    expected = t64(case["expected_lse"])  # [num_heads, query_len], natural log
    assert lse.shape == expected.shape
    torch.testing.assert_close(lse, expected, atol=ATOL, rtol=0, msg=case["convention"])


def test_golden_file_covers_every_convention() -> None:
    names = {c["name"] for c in GOLD["cases"]}
    assert {"decode", "chunked_prefill", "sliding_window", "softcap", "alibi", "sinks"} <= names
    assert GOLD["merge"] is not None


def test_merge_attn_states_reproduces_golden_merge() -> None:
    m = GOLD["merge"]
    out, lse = reference.merge_attn_states(
        t64(m["a_output"]), t64(m["a_lse"]), t64(m["b_output"]), t64(m["b_lse"])
    )
    torch.testing.assert_close(out, t64(m["expected_output"]), atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, t64(m["expected_lse"]), atol=ATOL, rtol=0)
