"""Graph-mode cases: for every backend that declares graph support (GraphSupport above NEVER),
the configurations its graphs are checked in, and the uniform query lengths it captures.

A graph case runs a model of two layers through ``attnhub.graphs.GraphRunner`` on the
backend's own graph adaptor (``backend.graph_adaptor()``: the eager tape on a CPU, CUDA or NPU
graphs on their devices, a vendor's emulated graph API under emulation) over several capture
sizes and many batches per size (see ``test_graphs``).
"""

from __future__ import annotations

from attnhub import GraphSupport
from attnhub.spec import AttentionType
from attnhub_conformance.cases import DECODE, Axes, Case, Cases, Scope
from attnhub_conformance.targets import Target

ROW = "graph capture"


def query_lens_for(level: GraphSupport, multi_token_decode: bool) -> tuple[int, ...]:
    """The uniform query lengths a level captures: 1, and 2 (speculative decode) from
    UNIFORM_BATCH on where the backend declares multi-token decode."""
    if level >= GraphSupport.UNIFORM_BATCH and multi_token_decode:
        return (1, 2)
    return (1,)


def graph_cases(target: Target, scope: Scope) -> list[Case]:
    ax = Axes(target, scope)
    base = ax.base
    if base is None or base.attn_type is not AttentionType.DECODER:
        return []
    out = Cases(target, "graphs", scope)
    level = ax.caps.graph_capture
    if level == GraphSupport.NEVER:
        out.add(
            ROW,
            "the backend declares no graph support (GraphSupport.NEVER)",
            name="graphs",
            skip="the backend declares GraphSupport.NEVER (refusal: see the refusals cases)",
            not_supported=True,
        )
        return out.list()
    proves = (
        f"GraphRunner captures ({level.name}) at several sizes; many batches per descriptor "
        "replay like eager forward and the reference, write the cache as eager does, with "
        "no host sync inside capture"
    )
    if level == GraphSupport.ALWAYS:
        proves += "; mixed batches (decodes beside longer queries) through mixed descriptors too"
    configs = [base]
    combined = ax.combined_features(base)
    configs += [combined] if combined else []
    # each feature alone too: a backend may capture some features and not others (its
    # builder's graph_support is per spec)
    configs += [base.with_(features=(f,)) for f in ax.features]
    configs += [base.with_(kv_cache_dtype=k) for k in ax.kv_cache_dtypes]
    if scope.full:
        configs += [base.with_(dtype=d) for d in ax.dtypes]
    for config in configs:
        out.add(ROW, proves, config=config, shape=DECODE, name=f"graphs-{config.id}")
    return out.list()
