"""MLA conformance cases (the absorbed form), generated from a backend's ``Capabilities.mla``.

Where MLA is declared: batch shapes within ``max_query_len`` (decode, prefill, chunked prefill
with context, mixed with padding), every declared dtype, block sizes, latent layouts, latent
formats (fp8), the DeepSeek latent size where served, each checked against
``attnhub.reference.paged_mla_absorbed`` with the KV write byte-exact (fp8: also against vLLM's
bytes from first principles, ``attnhub_conformance.mla_fp8``, with a write of edge values:
ties, saturation, subnormals); the LSE where declared
(refused with a typed error elsewhere); bad input (a latent of the wrong width, a rope part
missing, an undeclared layout ...) a typed error with the cache byte-identical; what is not
declared refused with reasons. Where it is not declared: MLA specs refused, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from attnhub.errors import UnsupportedConfigurationError
from attnhub.mla import LATENT_KV_CACHE_DTYPES, LATENT_LAYOUTS, MLASpec
from attnhub_conformance.cases import (
    DTYPE_NAMES,
    DTYPE_PREFERENCE,
    BatchPlan,
    Case,
    Scope,
)
from attnhub_conformance.targets import Target

#: The small latent the quick cases use where any is served: (kv_lora_rank, qk_rope_head_dim).
SMALL_LATENT = (64, 16)
DEEPSEEK_LATENT = (512, 64)
NUM_HEADS = 8
QK_NOPE = 32  # the expanded head (qk_nope + rope) sets the scale: 48 ** -0.5 with SMALL_LATENT


@dataclass(frozen=True)
class MLAConfig:
    """One MLA layer configuration: everything that goes into an MLASpec, and the layout."""

    dtype: torch.dtype
    block_size: int
    latent: tuple[int, int]
    layout: str
    kv_cache_dtype: str = "auto"
    num_heads: int = NUM_HEADS

    def spec(self) -> MLASpec:
        return MLASpec(
            num_heads=self.num_heads,
            kv_lora_rank=self.latent[0],
            qk_rope_head_dim=self.latent[1],
            qk_nope_head_dim=QK_NOPE,
            v_head_dim=QK_NOPE,
            dtype=self.dtype,
            block_size=self.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    @property
    def id(self) -> str:
        parts = [
            DTYPE_NAMES[self.dtype],
            f"r{self.latent[0]}+{self.latent[1]}",
            f"h{self.num_heads}",
            f"bs{self.block_size}",
            self.layout,
        ]
        if self.kv_cache_dtype != "auto":
            parts.append(f"kv_{self.kv_cache_dtype}")
        return "-".join(parts)


@dataclass(frozen=True)
class MLACase(Case):
    mla: MLAConfig | None = None
    batch_plan: BatchPlan | None = None


# --- batch shapes (lengths relative to the block size) ---------------------------------------
def _shapes(bs: int) -> dict[str, BatchPlan]:
    return {
        "decode": BatchPlan(
            tuple((1, s) for s in (bs + 1, 3, 2 * bs, 5 * bs - 3, 1, 4 * bs + 9)), padding=2
        ),
        "prefill": BatchPlan(tuple((n, n) for n in (bs + 5, 2 * bs, 3, 1))),
        "chunked_prefill": BatchPlan(((19, 19 + 3 * bs + 5), (bs + 1, 6 * bs), (1, 2 * bs + 1))),
        "multi_token_decode": BatchPlan(((2, 3 * bs + 2), (3, 17), (1, 40), (4, 5))),
        "mixed": BatchPlan(
            ((1, 3 * bs + 1), (3, 3 + bs), (1, 9), (bs + 3, bs + 3), (9, 9 + 2 * bs + 3), (1, 1)),
            padding=3,
        ),
    }


def shape_fits(plan: BatchPlan, max_query_len: int | None) -> bool:
    return max_query_len is None or max(plan.query_lens) <= max_query_len


#: Invalid inputs: name -> what it is (the test provokes each; the cache must stay as it was).
INVALID = {
    "latent_too_wide": "kv_c one column wider than kv_lora_rank",
    "rope_missing": "k_pe None while kv_c is given",
    "rope_too_narrow": "k_pe one column narrower than qk_rope_head_dim",
    "latent_wrong_dtype": "kv_c in another dtype than the model's",
    "query_expanded_width": "a query of the expanded form's width (qk_nope + rope)",
    "output_wrong_width": "an output buffer of v_head_dim instead of kv_lora_rank",
    "cache_other_block_size": "a latent cache of another block size",
    "cache_undeclared_layout": "a latent cache in a layout the backend does not declare",
    "cache_other_format": "a latent cache in another format (auto / fp8) than the spec's",
    "meta_of_other_spec": "metadata built for an MLA layer of another block size",
    "write_kv_slot_outside": "write_kv with a slot past the cache's last",
}

ROW = "mla:"


def refused_here(target: Target, config: MLAConfig) -> bool:
    """Whether ``target`` refuses MLA as a whole where the suite runs, although it declares it:
    a declaration made without asking the device (flash's fa4 declares its Blackwell MLA at
    import, and refuses it on a Hopper GPU; FA3's providers construct no MLA layer off Hopper).
    A refusal of the declared ``config`` for one of its fields is not that: its output cases
    then fail, naming the mismatch."""
    spec = config.spec()
    reasons = target.refusal(spec)  # type: ignore[arg-type]
    if reasons:
        return all(getattr(r, "field", None) == "mla" for r in reasons)
    try:  # a native backend's device refusals come at construction only
        target.create(spec)  # type: ignore[arg-type]
    except UnsupportedConfigurationError:
        return True
    return False


def mla_cases(target: Target, scope: Scope) -> list[Case]:
    caps = target.capabilities
    mla = caps.mla
    cases: dict[str, MLACase] = {}

    def add(row: str, name: str, proves: str, **kw: Any) -> None:
        old = cases.get(name)
        if old is not None:
            if row not in old.rows:
                cases[name] = MLACase(**{**old.__dict__, "rows": (*old.rows, row)})
            return
        cases[name] = MLACase(
            target=target, kind="mla", name=name, rows=(row,), proves=proves, scope=scope, **kw
        )

    if not mla.declared:
        config = MLAConfig(torch.bfloat16, 16, DEEPSEEK_LATENT, "joint")
        add(
            f"{ROW} absorbed form",
            f"refused-{config.id}",
            "an MLA spec is refused at construction with the backend's reason",
            mla=config,
            entry="undeclared",
            not_supported=True,
        )
        return list(cases.values())

    dtypes = [d for d in DTYPE_PREFERENCE if d in mla.dtypes]
    blocks = [
        b
        for b in dict.fromkeys([*scope.block_sizes, *sorted(mla.block_sizes or ())])
        if (mla.block_sizes is None or b in mla.block_sizes) and b % mla.block_size_multiple == 0
    ]
    latents = sorted(mla.latent_sizes) if mla.latent_sizes is not None else [SMALL_LATENT]
    if not dtypes or not blocks:
        return []
    # the quick cases' head count, or the fewest the kernels take where they name some
    heads = NUM_HEADS if mla.num_heads is None or NUM_HEADS in mla.num_heads else min(mla.num_heads)
    base = MLAConfig(dtypes[0], blocks[0], latents[0], mla.layouts[0], num_heads=heads)
    if refused_here(target, base):
        add(
            f"{ROW} absorbed form",
            f"refused-here-{base.id}",
            "an MLA spec the backend declares but refuses as a whole on this device is refused "
            "at construction",
            mla=base,
            entry="refused_here",
            not_supported=True,
        )
        return list(cases.values())
    shapes = _shapes(base.block_size)
    served = {n: p for n, p in shapes.items() if shape_fits(p, mla.max_query_len)}
    main = "mixed" if "mixed" in served else "decode"

    def out_case(row: str, config: MLAConfig, shape: str, proves: str) -> None:
        plan = _shapes(config.block_size)[shape]
        add(
            row,
            f"{shape}-{config.id}",
            proves,
            mla=config,
            batch_plan=plan,
            entry="output",
        )

    for name in served:
        out_case(
            f"{ROW} batch shapes",
            base,
            name,
            "the latent output equals the reference's absorbed form; the write is byte-exact",
        )
    for d in dtypes:
        out_case(f"{ROW} dtypes", replace(base, dtype=d), main, "every declared dtype")
    for b in blocks[: (None if scope.full else 3)]:
        config = replace(base, block_size=b)
        out_case(f"{ROW} block sizes", config, main, "block sizes")
    for layout in mla.layouts:
        config = replace(base, layout=layout)
        out_case(f"{ROW} layouts", config, main, "every declared latent layout")
    for kv in sorted(mla.kv_cache_dtypes - {"auto"}):
        for layout in mla.layouts:
            config = replace(base, layout=layout, kv_cache_dtype=kv)
            out_case(f"{ROW} fp8 latent", config, main, "fp8 latent caches, as stored")
            add(
                f"{ROW} fp8 kv writes",
                f"kv_write-{config.id}",
                "an fp8 latent write stores vLLM's bytes (concat_and_cache_mla): x / scale "
                "rounded to nearest even, saturated, the rope part over the one scale too",
                mla=config,
                entry="kv_write_fp8",
            )
    if base.latent != DEEPSEEK_LATENT and (
        mla.latent_sizes is None or DEEPSEEK_LATENT in mla.latent_sizes
    ):
        few = 4 if mla.num_heads is None or 4 in mla.num_heads else heads
        config = replace(base, latent=DEEPSEEK_LATENT, num_heads=few)
        out_case(f"{ROW} batch shapes", config, "decode", "DeepSeek's 512 + 64 latent")
    out_case(f"{ROW} kv writes", base, main, "the write of (kv_c, k_pe) is byte-exact")
    # the LSE where declared; a typed refusal where not
    for d in dtypes:
        config = replace(base, dtype=d)
        declared = mla.lse.refusal(config.spec()) is None
        add(
            f"{ROW} lse",
            f"lse-{'value' if declared else 'refused'}-{main}-{config.id}",
            "the LSE is the reference's" if declared else "return_lse is refused, cache intact",
            mla=config,
            batch_plan=shapes[main],
            entry="lse" if declared else "lse_refused",
            not_supported=not declared,
        )
    # bad input over the first layout's cache, and over an fp8 one (its bytes and its scale
    # untouched) where one is declared
    fp8 = sorted(mla.kv_cache_dtypes - {"auto"})
    for config in [base, *(replace(base, kv_cache_dtype=kv) for kv in fp8[:1])]:
        suffix = "" if config.kv_cache_dtype == "auto" else f"-kv_{config.kv_cache_dtype}"
        for entry, what in INVALID.items():
            if entry == "cache_undeclared_layout" and set(mla.layouts) == set(LATENT_LAYOUTS):
                continue
            add(
                f"{ROW} invalid inputs",
                f"invalid-{entry}{suffix}",
                f"{what}: a typed error, the cache byte-identical",
                mla=config,
                batch_plan=shapes[main],
                entry=entry,
            )
    _refusal_cases(add, base, mla, shapes)
    return list(cases.values())


def _refusal_cases(add: Any, base: MLAConfig, mla: Any, shapes: dict[str, BatchPlan]) -> None:
    """What is not declared is refused: a dtype, a latent format, a block size, a latent size
    (at construction, with reasons), a query longer than ``max_query_len`` (at build)."""
    refused: list[tuple[str, MLAConfig]] = []
    other = [d for d in DTYPE_PREFERENCE if d not in mla.dtypes]
    if other:
        refused.append(("dtype", replace(base, dtype=other[0])))
    for kv in LATENT_KV_CACHE_DTYPES:
        if kv not in mla.kv_cache_dtypes:
            refused.append(("kv_cache_dtype", replace(base, kv_cache_dtype=kv)))
    for b in (24, 1, 8, 32, 64):
        if (
            mla.block_sizes is not None and b not in mla.block_sizes
        ) or b % mla.block_size_multiple:
            refused.append(("block_size", replace(base, block_size=b)))
            break
    if mla.latent_sizes is not None:
        odd = (96, 32) if (96, 32) not in mla.latent_sizes else (48, 8)
        refused.append(("latent_size", replace(base, latent=odd)))
    if mla.num_heads is not None:
        odd_heads = next(h for h in (NUM_HEADS, 12, 3) if h not in mla.num_heads)
        refused.append(("num_heads", replace(base, num_heads=odd_heads)))
    for field_name, config in refused:
        add(
            f"{ROW} refusals",
            f"refused-{field_name}-{config.id}",
            f"an undeclared {field_name} is refused at construction with a reason",
            mla=config,
            entry="refused",
            not_supported=True,
        )
    if mla.max_query_len is not None:
        plan = next(p for p in shapes.values() if not shape_fits(p, mla.max_query_len))
        add(
            f"{ROW} refusals",
            f"refused-query_len-{base.id}",
            f"a request longer than max_query_len {mla.max_query_len} is refused at build",
            mla=base,
            batch_plan=plan,
            entry="refused_query_len",
            not_supported=True,
        )
