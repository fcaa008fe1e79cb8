"""Generate ``mla_golden.json``: tiny MLA cases computed in float64 with plain loops over numpy
arrays, written apart from ``attnhub.reference`` (no torch, no attnhub) so that the reference
can be checked against them.

Run from the repository root: ``python tests/data/make_mla_golden.py`` (the output is
deterministic; commit it with this script).

Conventions written out here, as DeepSeek-V2 defines MLA:
- per token a latent ``kv_c`` [L] and a rope key ``k_pe`` [R], shared by the heads;
- weights ``w_uk`` [L, H, P] and ``w_uv`` [L, H, V] (vLLM's split of ``kv_b_proj``);
- head h's key at position j is ``[sum_l kv_c[j, c] w_uk[l, h, :] ; k_pe[j]]``, its value
  ``sum_l kv_c[j, c] w_uv[l, h, :]``; its query ``[q_nope ; q_pe]``;
- score = scale * (query . key), scale = (P + R) ** -0.5 unless the case gives one;
- query i of a request with ``query_len`` new tokens out of ``seq_len`` sits at position
  ``seq_len - query_len + i`` and sees keys 0..that position (bottom-right causal);
- lse = natural log of the sum of exp(score) over the visible keys.
Each case also holds the absorbed form's latent output per head (attention weights times
``kv_c``), computed by a second loop over queries moved into latent space; the script checks
that projecting it by ``w_uv`` gives the expanded output.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "mla_golden.json"
H, L, R, P, V = 2, 4, 2, 3, 3


def rounded(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Normal draws on a grid of 1/16 within +-4: exact in float32 and bfloat16, so a cache in
    a model dtype holds the very inputs."""
    return np.clip(np.round(rng.standard_normal(shape) * 16) / 16, -4, 4)


def softmax_row(scores: list[float]) -> tuple[list[float], float]:
    m = max(scores)
    total = sum(math.exp(s - m) for s in scores)
    return [math.exp(s - m) / total for s in scores], m + math.log(total)


def expanded(case: dict) -> tuple[np.ndarray, np.ndarray]:  # out [q, H, V], lse [H, q]
    q_nope, q_pe = np.array(case["q_nope"]), np.array(case["q_pe"])
    kv_c, k_pe = np.array(case["kv_c"]), np.array(case["k_pe"])
    w_uk, w_uv = np.array(case["w_uk"]), np.array(case["w_uv"])
    q_len, seq_len, scale = case["query_len"], case["seq_len"], case["scale"]
    out = np.zeros((q_len, H, V))
    lse = np.zeros((H, q_len))
    for h in range(H):
        keys, values = [], []
        for j in range(seq_len):
            k_nope = [sum(kv_c[j, c] * w_uk[c, h, p] for c in range(L)) for p in range(P)]
            keys.append(k_nope + list(k_pe[j]))
            values.append([sum(kv_c[j, c] * w_uv[c, h, v] for c in range(L)) for v in range(V)])
        for i in range(q_len):
            q = list(q_nope[i, h]) + list(q_pe[i, h])
            pos = seq_len - q_len + i
            scores = [
                scale * sum(a * b for a, b in zip(q, keys[j], strict=True)) for j in range(pos + 1)
            ]
            weights, lse[h, i] = softmax_row(scores)
            for v in range(V):
                out[i, h, v] = sum(weights[j] * values[j][v] for j in range(pos + 1))
    return out, lse


def absorbed(case: dict) -> tuple[np.ndarray, np.ndarray]:  # out [q, H, L], lse [H, q]
    q_nope, q_pe = np.array(case["q_nope"]), np.array(case["q_pe"])
    kv_c, k_pe = np.array(case["kv_c"]), np.array(case["k_pe"])
    w_uk = np.array(case["w_uk"])
    q_len, seq_len, scale = case["query_len"], case["seq_len"], case["scale"]
    out = np.zeros((q_len, H, L))
    lse = np.zeros((H, q_len))
    for h in range(H):
        for i in range(q_len):
            ql = [sum(q_nope[i, h, p] * w_uk[c, h, p] for p in range(P)) for c in range(L)]
            q = ql + list(q_pe[i, h])
            pos = seq_len - q_len + i
            keys = [list(kv_c[j]) + list(k_pe[j]) for j in range(pos + 1)]
            scores = [scale * sum(a * b for a, b in zip(q, k, strict=True)) for k in keys]
            weights, lse[h, i] = softmax_row(scores)
            for c in range(L):
                out[i, h, c] = sum(weights[j] * kv_c[j, c] for j in range(pos + 1))
    return out, lse


def make_case(
    name: str, convention: str, q_len: int, seq_len: int, seed: int, scale: float | None = None
) -> dict:
    rng = np.random.default_rng(seed)
    case = {
        "name": name,
        "convention": convention,
        "query_len": q_len,
        "seq_len": seq_len,
        "num_heads": H,
        "kv_lora_rank": L,
        "qk_rope_head_dim": R,
        "qk_nope_head_dim": P,
        "v_head_dim": V,
        "scale": (P + R) ** -0.5 if scale is None else scale,
        "q_nope": rounded(rng, q_len, H, P).tolist(),
        "q_pe": rounded(rng, q_len, H, R).tolist(),
        "kv_c": rounded(rng, seq_len, L).tolist(),
        "k_pe": rounded(rng, seq_len, R).tolist(),
        "w_uk": rounded(rng, L, H, P).tolist(),
        "w_uv": rounded(rng, L, H, V).tolist(),
    }
    out, lse = expanded(case)
    latent, latent_lse = absorbed(case)
    projected = np.einsum("ihl,lhv->ihv", latent, np.array(case["w_uv"]))
    assert np.allclose(projected, out, atol=1e-12, rtol=0), name
    assert np.allclose(latent_lse, lse, atol=1e-12, rtol=0), name
    case["expected_output"] = out.tolist()
    case["expected_latent_output"] = latent.tolist()
    case["expected_lse"] = lse.tolist()
    return case


def main() -> None:
    cases = [
        make_case("decode", "one new token after 4 cached ones sees all 5 latents", 1, 5, 1),
        make_case(
            "chunked_prefill",
            "3 new tokens after 3 cached ones: bottom-right causal, query i sees 0..3+i",
            3,
            6,
            2,
        ),
        make_case("prefill", "4 new tokens, no context: causal from position 0", 4, 4, 3),
        make_case(
            "given_scale",
            "a model's own softmax scale (YaRN mscale) replaces (P + R)^-0.5 in both forms",
            2,
            5,
            4,
            scale=0.8,
        ),
    ]
    about = (
        "Tiny MLA cases (DeepSeek-V2 latent attention) in float64 from plain loops; inputs on a "
        "grid of 1/16, exact in float32 and bfloat16 "
        "(tests/data/make_mla_golden.py). Shapes: q_nope [query_len, H, P], q_pe [query_len, H, "
        "R], kv_c [seq_len, L], k_pe [seq_len, R] (the whole sequence; the last query_len "
        "positions are the new tokens), w_uk [L, H, P], w_uv [L, H, V]; expected_output "
        "[query_len, H, V] (expanded form), expected_latent_output [query_len, H, L] (absorbed "
        "form, before w_uv), expected_lse [H, query_len] (natural log, both forms)."
    )
    OUT.write_text(json.dumps({"about": about, "cases": cases}, indent=1) + "\n")


if __name__ == "__main__":
    main()
