"""``torch.compile`` cases: a small decoder layer (q/k/v projections, the backend's attention
through ``attnhub.attention``, the output projection) compiled with ``fullgraph=True`` once, then
run over engine steps of every declared kind, new lengths and batch sizes each (a one-token step
among them), the token dimension marked dynamic as an engine marks it.

Each step runs the same layer eagerly too (the backend's ``impl.forward`` called directly, its
return value used) on a cache of its own, and the compiled step must give its answer: the
attention output (into a NaN-filled buffer: one the backend leaves unwritten shows) and the
layer's output within the declared tolerance, padding rows zero; the cache holding exactly the
keys and values the compiled step wrote, nothing else changed; the cache's own planes handed to
the backend (a graph that copied the cache in and out would hand the op other memory, which the
op warns of); and one compilation for every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnhub import BatchMetadata, PagedKVCache, testing
from attnhub.backend import AttentionImpl, AttentionMetadata
from attnhub.spec import AttentionSpec, AttentionType
from attnhub_conformance import harness
from attnhub_conformance.cases import (
    Axes,
    BatchPlan,
    Case,
    Cases,
    Config,
    Scope,
    shapes_for,
)
from attnhub_conformance.targets import Target

ROW = "torch.compile"
#: The layer's hidden size (its projections map it to the heads and back).
HIDDEN = 64


def compiled_cases(target: Target, scope: Scope) -> list[Case]:
    """One compiled decoder layer per backend (quick scope: the base config, one compilation;
    full: each dtype), decoder backends only."""
    ax = Axes(target, scope)
    base = ax.base
    out = Cases(target, "compiled", scope)
    if base is None:
        return []
    if base.attn_type is not AttentionType.DECODER:
        out.add(
            ROW,
            "the compiled decoder layer needs decoder attention",
            name="compiled",
            skip="not applicable: the backend serves no decoder attention (the compiled layer "
            "is a decoder layer writing its KV cache)",
            not_applicable=True,
        )
        return out.list()
    proves = (
        "a decoder layer calling attnhub.attention compiles once (fullgraph, dynamic tokens) "
        "and runs every later step like eager; the cache holds what each compiled step wrote, "
        "written in place (no copy of the cache)"
    )
    configs = [base] + ([base.with_(dtype=d) for d in ax.dtypes] if scope.full else [])
    for config in configs:
        out.add(ROW, proves, config=config, name=f"compiled-{config.id}")
    return out.list()


def step_plans(target: Target, config: Config, scope: Scope) -> list[BatchPlan]:
    """Engine steps of every kind the backend declares, with new lengths and batch sizes each:
    each declared shape's batch, then each without its last request, then one lone decode (a
    one-token step)."""
    bs = config.block_size
    caps = target.capabilities
    full = [s.plan(bs, caps, scope) for s in shapes_for(caps, AttentionType.DECODER)]
    fewer = [
        BatchPlan(p.requests[:-1], padding=p.padding, shared_prefix_blocks=p.shared_prefix_blocks)
        for p in full
        if len(p.requests) > 1
    ]
    return [*full, *fewer, BatchPlan(((1, 2 * bs + 3),))]


def _weight(
    rows: int, cols: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> torch.Tensor:
    # drawn on the host (the generator's), the same bits on every device
    return (torch.randn(rows, cols, generator=gen) / math.sqrt(cols)).to(device, dtype)


class DecoderLayer(torch.nn.Module):
    """Projections, attention, output projection. ``compiled=True``: attention through
    ``attnhub.attention`` (the op) into the buffer given (an engine's persistent buffer; the
    suite's is NaN-filled, so one the backend leaves unwritten shows, and made outside the graph,
    so the graph compiles no kernel of its own: seconds less per backend on a small CPU); else
    ``impl.forward`` directly. Returns (layer output, attention output, keys, values)."""

    def __init__(
        self,
        spec: AttentionSpec,
        impl: AttentionImpl,
        cache: PagedKVCache,
        name: str,
        gen: torch.Generator,
        *,
        compiled: bool,
    ) -> None:
        super().__init__()
        h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_size
        shapes = ((h * d, HIDDEN), (hkv * d, HIDDEN), (hkv * d, HIDDEN), (HIDDEN, h * d))
        weights = [_weight(r, c, spec.dtype, cache.device, gen) for r, c in shapes]
        self.wq, self.wk, self.wv, self.wo = weights
        self.heads, self.kv_heads, self.head_size = h, hkv, d
        self.impl, self.cache, self.name, self.compiled = impl, cache, name, compiled

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, HIDDEN]
        buf: torch.Tensor | None = None,  # compiled: the attention's output buffer, NaN-filled
        meta: AttentionMetadata | None = None,  # eager: the step's metadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        import attnhub

        q = (x @ self.wq.t()).view(-1, self.heads, self.head_size)
        k = (x @ self.wk.t()).view(-1, self.kv_heads, self.head_size)
        v = (x @ self.wv.t()).view(-1, self.kv_heads, self.head_size)
        if self.compiled:
            attn = attnhub.attention(q, k, v, self.cache, self.name, output=buf)
        else:
            assert meta is not None  # the eager layer is given the step's metadata
            attn = self.impl.forward(q, k, v, self.cache, meta)
        y = attn.reshape(-1, self.heads * self.head_size) @ self.wo.t()
        return y, attn, k, v


@dataclass
class CompiledRun:
    """One backend's compiled and eager layers, over one cache each."""

    step: harness.Step
    eager: DecoderLayer
    compiled: DecoderLayer
    num_blocks: int


def batch_for(run: CompiledRun, plan: BatchPlan) -> BatchMetadata:
    """``plan`` as a step over the run's caches: its own shuffled block table."""
    s = run.step
    plan = harness.engine_order(plan, s.builder.reorder_batch_threshold)
    table = testing.shuffled_block_table(
        plan.seq_lens, s.spec.block_size, run.num_blocks, s.generator, extra_width=1
    )
    return BatchMetadata.from_lengths(
        plan.query_lens,
        plan.seq_lens,
        table,
        s.spec.block_size,
        s.device,
        causal=s.spec.causal,
        num_tokens=sum(plan.query_lens) + plan.padding,
    )


def twin_cache(step: harness.Step, cache: PagedKVCache, num_blocks: int) -> PagedKVCache:
    """A cache of the backend's own making (its planes alias as the backend's do) holding the
    same bytes as ``cache``."""
    twin = step.backend.allocate_kv_cache(num_blocks)
    for name, plane in twin.planes().items():
        plane.copy_(cache.planes()[name])
    for which in ("key_scale", "value_scale"):
        a, b = getattr(twin, which), getattr(cache, which)
        if a is not None and b is not None and a.data_ptr() != b.data_ptr():
            a.copy_(b)
    return twin
