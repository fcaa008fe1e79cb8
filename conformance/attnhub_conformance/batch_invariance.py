"""Batch invariance and determinism cases: the same request alone, first, last and among
companions of every kind, and the same step again through fresh objects.

One step (the *universe*) holds a few probe requests (a decode, a chunked prefill, a
multi-token decode, a prefill: those the backend declares) and their companions: decodes
shorter and longer than each probe, requests of a probe's own query length (which a backend
may batch into one call with it), a prefill, a long chunked prefill, and a crowd of decodes
(another total token count). Each *placement* is a sub-batch of the universe's requests (same
blocks, same inputs, a block table only as wide as the sub-batch needs), in the order an
engine would build it (decodes first where the builder asks). A probe's output rows in each
placement are compared with the probe alone:

- where the backend declares ``Capabilities.batch_invariant`` for the spec (the spec asking
  for it), bit for bit (``torch.equal`` of the bytes);
- elsewhere, within the declared tolerance, and a spec that asks for it is refused at
  construction with the backend's reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnhub import BatchMetadata
from attnhub.spec import AttentionType
from attnhub_conformance import harness
from attnhub_conformance.cases import (
    DECODE,
    Axes,
    BatchPlan,
    Case,
    Cases,
    Config,
    Scope,
    Shape,
    main_shape,
    shapes_for,
)
from attnhub_conformance.targets import Target

#: The matrix rows.
BITWISE_ROW = "batch invariance: bitwise"
PLACEMENTS_ROW = "batch invariance"  # the within-tolerance row the older test fills too
DETERMINISM_ROW = "determinism"

#: Decodes in the crowd placement: a total token count unlike any other placement's.
CROWD = 24
#: Keys of the longest companion: a decode past what the probes read, so that a kernel that
#: picks its splits or tiles from the batch's longest sequence picks others.
LONG_COMPANION_KEYS = 600


@dataclass(frozen=True)
class Probe:
    name: str  # decode, chunked_prefill, multi_token_decode, prefill
    request: tuple[int, int]  # (query_len, seq_len)


def probes(bs: int, multi_token_decode: bool, chunked_prefill: bool) -> list[Probe]:
    """The requests whose bits are followed from placement to placement."""
    out = [Probe("decode", (1, 3 * bs + 5))]
    if chunked_prefill:
        out.append(Probe("chunked_prefill", (9, 9 + 4 * bs + 2)))
    if multi_token_decode:
        out.append(Probe("multi_token_decode", (3, 3 + 2 * bs + 4)))
    out.append(Probe("prefill", (bs + 3, bs + 3)))
    return out


def companions(bs: int, probe: Probe, chunked_prefill: bool) -> dict[str, list[tuple[int, int]]]:
    """Per kind, the companions of ``probe``: other decodes (shorter, longer, much longer),
    requests of its own query length (shorter and longer), a prefill and a chunked prefill."""
    q, s = probe.request
    out = {
        "decodes": [(1, 2), (1, s + 2 * bs + 1), (1, bs), (1, LONG_COMPANION_KEYS + 7)],
        "same_query_len": [(q, q + 1 if q > 1 else 5), (q, s + 3 * bs + 1), (q, s + 1)],
        "prefill": [(2 * bs + 1, 2 * bs + 1)],
        "chunked_prefill": [(40, 40 + 6 * bs + 3)] if chunked_prefill else [],
    }
    if q == s:  # a prefill: its own query length means other prefills
        out["same_query_len"] = [(q + 5, q + 5), (q, q), (3 * q + 1, 3 * q + 1)]
    return out


def crowd(bs: int) -> list[tuple[int, int]]:
    return [(1, 1 + (7 * i) % (5 * bs) + i) for i in range(CROWD)]


@dataclass(frozen=True)
class Placement:
    name: str  # alone, first, last, among ..., in a crowd
    requests: tuple[int, ...]  # indices into the universe's requests (the universe's order)
    probe: int  # the probe's universe index


@dataclass(frozen=True)
class Universe:
    plan: BatchPlan  # every request any placement uses
    placements: tuple[Placement, ...]
    probes: dict[int, Probe]  # universe index -> the probe it is


def universe(bs: int, multi_token_decode: bool, chunked_prefill: bool) -> Universe:
    """Every probe and companion as one step, and the placements that cut it up."""
    reqs: list[tuple[int, int]] = []

    def add(group: list[tuple[int, int]]) -> list[int]:
        first = len(reqs)
        reqs.extend(group)
        return list(range(first, len(reqs)))

    placements: list[Placement] = []
    found: dict[int, Probe] = {}
    for probe in probes(bs, multi_token_decode, chunked_prefill):
        (p,) = add([probe.request])
        found[p] = probe
        kinds = {k: add(v) for k, v in companions(bs, probe, chunked_prefill).items()}
        mix = kinds["decodes"][:2] + kinds["prefill"] + kinds["chunked_prefill"]
        mix += kinds["same_query_len"][:1]
        crowded = add(crowd(bs))
        half = len(crowded) // 2
        for name, order in (
            ("alone", [p]),
            ("first, before decodes", [p, *kinds["decodes"]]),
            ("last, after decodes", [*kinds["decodes"], p]),
            ("first among its query length", [p, *kinds["same_query_len"]]),
            ("last among its query length", [*kinds["same_query_len"], p]),
            ("among decodes, prefills and chunked prefills", [*mix[:2], p, *mix[2:]]),
            (f"in a crowd of {CROWD} decodes", [*crowded[:half], p, *crowded[half:]]),
        ):
            placements.append(Placement(name, tuple(order), p))
    return Universe(BatchPlan(tuple(reqs)), tuple(placements), found)


def universe_shape(multi_token_decode: bool, chunked_prefill: bool) -> Shape:
    return Shape(
        "placements",
        "probe requests alone, first, last and among companions of every kind",
        lambda bs, caps, scope: universe(bs, multi_token_decode, chunked_prefill).plan,
    )


def engine_ordered(step: harness.Step, order: list[int]) -> list[int]:
    """``order`` as an engine would build it: decodes first where the builder asks
    (``reorder_batch_threshold``), the rest kept in order."""
    threshold = step.builder.reorder_batch_threshold
    if threshold is None:
        return order
    return sorted(order, key=lambda r: step.plan.requests[r][0] > threshold)


def step_index(step: harness.Step, plan: BatchPlan) -> list[int]:
    """Universe index -> the step's request index (``harness.prepare_step`` reorders as
    :func:`harness.engine_order` does: a stable sort, decodes first)."""
    threshold = step.builder.reorder_batch_threshold
    n = len(plan.requests)
    if threshold is None:
        return list(range(n))
    moved = sorted(range(n), key=lambda r: plan.requests[r][0] > threshold)
    where = [0] * n
    for new, old in enumerate(moved):
        where[old] = new
    return where


def placement_batch(
    step: harness.Step, layer: harness.Layer, order: list[int]
) -> tuple[BatchMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's requests ``order`` as a batch of their own (their blocks, their inputs), its
    block table as wide as they need plus one column (as an engine's table of this step)."""
    bs = step.spec.block_size
    reqs = [step.plan.requests[r] for r in order]
    width = max((s + bs - 1) // bs for _, s in reqs) + 1
    table = step.block_table[order][:, :width]
    batch = BatchMetadata.from_lengths(
        [q for q, _ in reqs],
        [s for _, s in reqs],
        table,
        bs,
        step.device,
        causal=step.spec.causal,
    )
    qsl = step.batch.query_start_loc_cpu.tolist()
    rows = torch.cat([torch.arange(qsl[r], qsl[r + 1]) for r in order]).to(step.device)
    return batch, layer.query[rows], layer.key[rows], layer.value[rows]


def probe_rows(step: harness.Step, order: list[int], probe: int) -> slice:
    """The probe's rows in the output of the placement ``order``."""
    at = order.index(probe)
    first = sum(step.plan.requests[r][0] for r in order[:at])
    return slice(first, first + step.plan.requests[probe][0])


# --- the cases --------------------------------------------------------------------------------


def batch_invariance_cases(target: Target, scope: Scope) -> list[Case]:
    """Per dtype the backend serves: bitwise where it declares ``batch_invariant`` for the spec
    (every dtype, each KV format and every feature at once at the base dtype), else within the
    tolerance plus the refusal of a spec that asks for it. Decoder layers only (the placements
    mix decodes, prefills and chunked prefills)."""
    ax = Axes(target, scope)
    out = Cases(target, "placements", scope)
    base = ax.base
    if base is None or base.attn_type is not AttentionType.DECODER:
        return []
    caps = ax.caps
    shape = universe_shape(caps.multi_token_decode, caps.chunked_prefill)
    configs = [base.with_(dtype=d) for d in ax.dtypes]
    combined = ax.combined_features(base)
    configs += [combined] if combined else [base.with_(features=(f,)) for f in ax.features]
    configs += [base.with_(kv_cache_dtype=k) for k in ax.kv_cache_dtypes]
    for config in configs:
        asking = config.with_(batch_invariant=True)
        if ax.supports(asking):
            out.add(
                BITWISE_ROW,
                "a request's output has the same bits alone, first, last and among "
                "decodes, prefills and chunked prefills of other lengths",
                config=asking,
                shape=shape,
                entry="bitwise",
                name=f"bitwise-{asking.id}",
            )
            continue
        refusal = caps.batch_invariant.refusal(asking.spec())
        if refusal is not None:
            out.add(
                BITWISE_ROW,
                "a spec asking for batch invariance is refused at construction with the "
                "backend's reason",
                config=asking,
                entry="refused",
                name=f"refused-{asking.id}",
                not_supported=True,
            )
        out.add(
            PLACEMENTS_ROW,
            "a request's output alone, first, last and among companions of every kind "
            "agrees within the declared tolerance",
            config=config,
            shape=shape,
            entry="tolerance",
            name=f"tolerance-{config.id}",
        )
    return out.list()


def determinism_cases(target: Target, scope: Scope) -> list[Case]:
    """The same step run again after steps of other shapes through the same builder and impl,
    and through a fresh backend instance: the same bits (per dtype; each KV format; every
    feature at once; a decode step and the mixed one)."""
    ax = Axes(target, scope)
    out = Cases(target, "determinism_again", scope)
    base = ax.base
    if base is None:
        return []
    proves = (
        "the same step gives the same bits after steps of other shapes through the same "
        "builder and impl, and through a fresh backend instance"
    )
    shapes = [main_shape(base.attn_type)]
    if base.attn_type is AttentionType.DECODER and DECODE in shapes_for(ax.caps, base.attn_type):
        shapes.append(DECODE)
    configs: list[Config] = [base.with_(dtype=d) for d in ax.dtypes]
    combined = ax.combined_features(base)
    configs += [combined] if combined else [base.with_(features=(f,)) for f in ax.features]
    configs += [base.with_(kv_cache_dtype=k) for k in ax.kv_cache_dtypes]
    for config in configs:
        for shape in shapes if config.dtype == base.dtype else shapes[:1]:
            out.add(DETERMINISM_ROW, proves, config=config, shape=shape)
    return out.list()


def describe(step: harness.Step, order: list[int], probe: int) -> str:
    """``request (3, 57) at position 2 of 5 (query lens [1, 1, 3, 40, 17])``."""
    reqs = [step.plan.requests[r] for r in order]
    q, s = step.plan.requests[probe]
    return (
        f"request (query_len {q}, seq_len {s}) at position {order.index(probe)} of {len(order)} "
        f"(query_lens {[r[0] for r in reqs]}, seq_lens {[r[1] for r in reqs]})"
    )
