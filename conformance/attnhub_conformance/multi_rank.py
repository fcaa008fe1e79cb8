"""Multi-rank cases: decode context parallel (``attnhub.context_parallel.DecodeContextParallel``)
through a backend, over real ``torch.distributed`` gloo groups spawned here: standard layers and
MLA layers in the absorbed form, both through :func:`dcp_sub_case`.

Every rank of a group builds the same step from one seed (decodes, a multi-token decode, a first
prefill chunk and a chunked prefill with context, in one step), keeps only its shard of the KV
cache (its unused slots seeded with NaN where the backend does not need finite stale slots),
runs the DCP layer call and reports, per sub-case: the output against the float64 reference and
against the same backend's single-rank run of the same step (the declared tolerance), the
padding rows, and whether its cache holds exactly its shard (against the single-rank cache).

:func:`run_group` is the harness (spawned processes, a deadline for the whole group, every
process reaped on any failure); a rank finds the backend by its registered name (an installed
plugin: entry points load in every process) or by ``"module:Class"``.
"""

from __future__ import annotations

import importlib
import math
import multiprocessing
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch

#: (name, query_lens, seq_lens) in units of the per-rank block size ``B`` and group size ``N``.
Lengths = Callable[[int, int], tuple[list[int], list[int]]]


def _decode(b: int, n: int) -> tuple[list[int], list[int]]:
    # a long sequence, one of two tokens (ranks past 1 hold none of it), one of one token
    return [1, 1, 1], [n * b + 3, 2, 1]


def _mixed(b: int, n: int) -> tuple[list[int], list[int]]:
    # decode, multi-token decode, a first prefill chunk, a chunked prefill with context
    return [1, 3, 6, 5], [2 * b + 1, n * b // 2 + 3, 6, n * b + 7]


DCP_STEPS: dict[str, Lengths] = {"decode": _decode, "mixed": _mixed}
PADDING_ROWS = 2
#: The whole group's deadline (start-up included: N processes import torch on few cores).
DEADLINE_S = 240.0


@dataclass(frozen=True)
class SubCase:
    step: str
    interleave: int
    sinks: bool
    variant: str = "all_gather_reduce_scatter"

    @property
    def id(self) -> str:
        return f"{self.step}-I{self.interleave}-{self.variant}{'-sinks' if self.sinks else ''}"


def sub_cases(block_size: int, sinks: bool) -> list[SubCase]:
    """Every step, interleave 1 and ``block_size``, both communication variants in turn, with
    and without sinks where the backend declares them."""
    out = []
    for i, (step, interleave) in enumerate(
        (s, il) for s in DCP_STEPS for il in dict.fromkeys((1, block_size))
    ):
        variant = ("all_gather_reduce_scatter", "all_to_all")[i % 2]
        out.append(SubCase(step, interleave, False, variant))
        if sinks:
            out.append(SubCase(step, interleave, True, variant))
    return out


def backend_ref(cls: type[Any], name: str) -> str:
    """How a spawned rank finds ``cls``: ``"module:Class"`` where a fresh process can import
    it (a backend registered in-process, e.g. by a pytest plugin, is not in the registry
    there), else its registered ``name``."""
    if "<locals>" in cls.__qualname__ or cls.__module__ == "__main__":
        return name
    return f"{cls.__module__}:{cls.__qualname__}"


def load_backend(ref: str) -> type[Any]:
    """A backend class by its registered name, or ``"module:Class"``."""
    if ":" in ref:
        module, _, name = ref.partition(":")
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj
    import attnhub

    return attnhub.get_backend(ref)


# --- what every rank runs ----------------------------------------------------------------------


def _single_rank_table(seq_lens: list[int], b: int) -> tuple[torch.Tensor, int]:
    """The single-rank run's block table (distinct blocks from 1, in order) and the number of
    blocks its cache needs, less one."""
    table = torch.zeros(len(seq_lens), max(-(-s // b) for s in seq_lens), dtype=torch.int32)
    nxt = 1
    for r, s in enumerate(seq_lens):
        for j in range(-(-s // b)):
            table[r, j], nxt = nxt, nxt + 1
    return table, nxt


def _write_context(
    impl: Any,
    cache: Any,
    query_lens: list[int],
    seq_lens: list[int],
    first: list[torch.Tensor],
    second: list[torch.Tensor],
    dev: Any,
    slots_of: Any,
) -> None:
    """Write each request's context (its tokens before the step: keys and values, or latents
    and rope parts) at ``slots_of(request, positions)``, one ``write_kv`` per request."""
    for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if s == q:
            continue
        pos = torch.arange(s - q)
        impl.write_kv(first[r][: s - q].to(dev), second[r][: s - q].to(dev), cache,
                      slots_of(r, pos).to(dev))  # fmt: skip


def _single_rank_run(
    single: Any,
    s_impl: Any,
    s_cache: Any,
    s_batch: Any,  # BatchMetadata
    query: torch.Tensor,
    new_a: torch.Tensor,
    new_b: torch.Tensor,
    heads: slice,
) -> torch.Tensor | None:
    """The step on one rank (every head, the whole cache): this rank's heads of its output, or
    None where the backend refuses the step at build (one that declares no chunked prefill or
    multi-token decode, or whose MLA kernels take shorter queries: DCP serves it, decodes only,
    and the reference judges). Either way the step's new rows (``new_a``, ``new_b``: keys and
    values, or kv_c and k_pe) are in ``s_cache`` afterwards."""
    from attnhub.errors import UnsupportedConfigurationError

    try:
        meta = single.metadata_builder().build(s_batch)
    except UnsupportedConfigurationError:
        s_impl.write_kv(new_a, new_b, s_cache, s_batch.slot_mapping)
        return None
    want = s_impl.forward(query, new_a, new_b, s_cache, meta)
    return want.to("cpu")[:, heads]


def _output_errors(
    what: str,
    out: torch.Tensor,  # [tokens + padding, heads of this rank, head_size_v]
    lse: torch.Tensor,  # [tokens + padding, heads of this rank]
    tokens: int,
    ref: torch.Tensor,  # the reference's output, this rank's heads
    ref_lse: torch.Tensor,  # [heads of this rank, tokens]
    single_rank: torch.Tensor | None,
    tol: Any,
) -> list[str]:
    """What is wrong with a rank's merged output and LSE: against the reference and the
    single-rank run (where there is one) within ``tol``, padding rows zero (output) and +inf
    (LSE), every value finite."""
    from attnhub import testing

    errors = []
    compared = [("the reference", ref)]
    if single_rank is not None:
        compared.append(("the single-rank run", single_rank))
    for name, expected in compared:
        why = testing.mismatch(out[:tokens], expected[:tokens].double(), tol)
        if why is not None:
            errors.append(f"{what} output vs {name} (atol={tol.atol:g} rtol={tol.rtol:g}): {why}")
    why = testing.mismatch(lse[:tokens], ref_lse.t()[:tokens], tol)
    if why is not None:
        errors.append(f"the merged LSE vs the reference's: {why}")
    if not bool((out[tokens:] == 0).all()) or not bool(torch.isposinf(lse[tokens:]).all()):
        errors.append("padding rows are not zero (output) and +inf (LSE)")
    if not bool(torch.isfinite(out).all()):
        errors.append("the output holds a non-finite value")
    return errors


class _StandardLayer:
    """What a DCP sub-case needs to know of a standard layer: keys and values per request (kv
    heads), sinks where the sub-case has them, a paged KV cache."""

    label = "DCP"

    def __init__(self, spec: Any, sinks: bool) -> None:
        self.spec = replace(spec, use_sinks=sinks)

    def planes(self, seq_lens: list[int], g: torch.Generator) -> tuple[list[torch.Tensor], ...]:
        shape = (self.spec.num_kv_heads, self.spec.head_size)
        return tuple(
            [torch.randn(s, *shape, generator=g).to(self.spec.dtype) for s in seq_lens]
            for _ in range(2)
        )

    def query_width(self) -> int:
        return int(self.spec.head_size)

    def seed_nan(self, cache: Any) -> None:
        with cache.edit() as plain:
            plain.key.fill_(math.nan)
            plain.value.fill_(math.nan)

    def reference(self, query: torch.Tensor, cache: Any, batch: Any, spec: Any, sinks: Any) -> Any:
        from attnhub import reference

        return reference.paged_attention(query, cache, batch, spec, sinks=sinks)

    def tolerance(self, caps: Any) -> Any:
        return caps.tolerances.get(self.spec.dtype)

    def read(self, cache: Any, table_row: torch.Tensor, length: int) -> tuple[torch.Tensor, ...]:
        from attnhub import reference

        return tuple(reference.read_sequence(cache, table_row, length))

    def finite_slots(self, cache: Any) -> int:
        with cache.edit() as plain:
            rows = (
                plain.key_nhd().to("cpu").reshape(-1, self.spec.num_kv_heads * self.spec.head_size)
            )
        return int(torch.isfinite(rows.float()).all(dim=1).sum())


class _LatentLayer:
    """The same for an MLA layer in the absorbed form: latents and rope parts per request (no
    kv heads: every rank holds the latents of its tokens), no sinks, a latent cache."""

    label = "MLA DCP"

    def __init__(self, spec: Any, sinks: bool) -> None:
        assert not sinks, "MLA layers have no sinks"
        self.spec = spec

    def planes(self, seq_lens: list[int], g: torch.Generator) -> tuple[list[torch.Tensor], ...]:
        widths = (self.spec.kv_lora_rank, self.spec.qk_rope_head_dim)
        return tuple(
            [torch.randn(s, w, generator=g).to(self.spec.dtype) for s in seq_lens] for w in widths
        )

    def query_width(self) -> int:
        return int(self.spec.latent_size)

    def seed_nan(self, cache: Any) -> None:
        cache.kv_c.fill_(math.nan)
        cache.k_pe.fill_(math.nan)

    def reference(self, query: torch.Tensor, cache: Any, batch: Any, spec: Any, sinks: Any) -> Any:
        from attnhub import reference

        return reference.paged_mla_absorbed(query, cache, batch, spec)

    def tolerance(self, caps: Any) -> Any:
        return caps.mla.tolerances.get(self.spec.dtype) or caps.tolerances.get(self.spec.dtype)

    def read(self, cache: Any, table_row: torch.Tensor, length: int) -> tuple[torch.Tensor, ...]:
        from attnhub import reference

        return tuple(reference.read_latent_sequence(cache, table_row, length))

    def finite_slots(self, cache: Any) -> int:
        rows_c = cache.kv_c.to("cpu").reshape(-1, self.spec.kv_lora_rank).float()
        rows_pe = cache.k_pe.to("cpu").reshape(-1, self.spec.qk_rope_head_dim).float()
        return int((torch.isfinite(rows_c).all(dim=1) & torch.isfinite(rows_pe).all(dim=1)).sum())


def dcp_sub_case(
    comm: Any,
    backend_cls: type[Any],
    spec: Any,  # the rank's AttentionSpec (its heads, without sinks), or its MLASpec
    device: str,
    emulate: bool,
    sub: SubCase,
    seed: int,
    *,
    per_rank_sinks: bool = False,
) -> dict[str, Any]:
    """One DCP step on this rank; what it found (see the module docstring). ``per_rank_sinks``
    also reports the error of a wrong merge that lets every rank's kernel add the sinks (the
    check's sensitivity).

    An MLA layer (``spec`` an ``MLASpec``) runs the absorbed form the same way: the rank keeps
    its shard of the latent cache, the query heads are gathered, the rank's MLA call returns
    its LSE, the partials merge by it; judged against ``reference.paged_mla_absorbed``."""
    from attnhub import BatchMetadata, testing
    from attnhub.context_parallel import DecodeContextParallel, local_slot_mapping, token_rank
    from attnhub.mla import MLASpec

    layer = (_LatentLayer if isinstance(spec, MLASpec) else _StandardLayer)(spec, sub.sinks)
    spec = layer.spec
    n, rank = comm.world_size, comm.rank
    b, hl = spec.block_size, spec.num_heads
    query_lens, seq_lens = DCP_STEPS[sub.step](b, n)
    g = testing.generator(seed)
    virtual = n * b
    num_blocks = testing.num_blocks_for(seq_lens, virtual)
    table = testing.shuffled_block_table(seq_lens, virtual, num_blocks, g)
    tokens = sum(query_lens)
    batch = BatchMetadata.from_lengths(
        query_lens, seq_lens, table, virtual, device, num_tokens=tokens + PADDING_ROWS
    )
    first, second = layer.planes(seq_lens, g)
    query = torch.randn(tokens + PADDING_ROWS, n * hl, layer.query_width(), generator=g)
    query = query.to(spec.dtype)
    all_sinks = torch.randn(n * hl, generator=g) + 2.0 if sub.sinks else None
    heads = slice(rank * hl, (rank + 1) * hl)
    dev = torch.device(device)

    def new_rows(planes: list[torch.Tensor]) -> torch.Tensor:
        rows = [p[s - q :] for p, q, s in zip(planes, query_lens, seq_lens, strict=True)]
        packed = torch.cat(rows)
        return torch.cat([packed, packed.new_zeros(PADDING_ROWS, *packed.shape[1:])]).to(dev)

    backend = backend_cls(spec, device, emulate=emulate)
    impl = backend.impl() if all_sinks is None else backend.impl(sinks=all_sinks[heads])
    dcp = DecodeContextParallel(backend, comm, world_size=n, interleave=sub.interleave)
    cache = backend.allocate_kv_cache(num_blocks)
    seeded_nan = not backend_cls.capabilities.finite_stale_slots
    if seeded_nan:
        layer.seed_nan(cache)
    _write_context(  # earlier steps' tokens, this rank's shard of them
        impl, cache, query_lens, seq_lens, first, second, dev,
        lambda r, pos: torch.from_numpy(
            local_slot_mapping(pos, torch.full_like(pos, r), table, b, n, rank, sub.interleave)
        ),
    )  # fmt: skip
    step = dcp.plan(batch)
    out, lse = dcp.forward(
        impl, step, query[:, heads].to(dev), new_rows(first), new_rows(second), cache,
        return_lse=True,
    )  # fmt: skip
    out, lse = out.to("cpu"), lse.to("cpu")

    # The same step on one rank: every head, the whole cache, the same backend.
    single_spec = replace(spec, num_heads=n * hl)
    single = backend_cls(single_spec, device, emulate=emulate)
    s_table, nxt = _single_rank_table(seq_lens, b)
    s_batch = BatchMetadata.from_lengths(
        query_lens, seq_lens, s_table, b, device, num_tokens=tokens + PADDING_ROWS
    )
    s_cache = single.allocate_kv_cache(nxt + 1)
    s_impl = single.impl() if all_sinks is None else single.impl(sinks=all_sinks)
    _write_context(
        s_impl, s_cache, query_lens, seq_lens, first, second, dev,
        lambda r, pos: s_table[r, pos // b].long() * b + pos % b,
    )  # fmt: skip
    want = _single_rank_run(
        single, s_impl, s_cache, s_batch, query.to(dev), new_rows(first), new_rows(second), heads
    )
    ref, ref_lse = layer.reference(query, s_cache, s_batch, single_spec, all_sinks)
    tol = layer.tolerance(backend_cls.capabilities)
    found: dict[str, Any] = {}
    if tol is None:
        found["errors"] = [f"the backend declares no {layer.label} tolerance for {spec.dtype}"]
        return found
    errors = _output_errors(layer.label, out, lse, tokens, ref[:, heads], ref_lse[heads], want, tol)
    # The rank's cache holds exactly its shard: the single-rank cache's tokens of this rank.
    local = [int(x) for x in step.shard.seq_lens]
    for r, s in enumerate(seq_lens):
        mine = torch.from_numpy(token_rank(torch.arange(s), n, sub.interleave) == rank)
        got = layer.read(cache, table[r], local[r])
        whole = layer.read(s_cache, s_table[r], s)
        if not all(torch.equal(a, w[mine]) for a, w in zip(got, whole, strict=True)):
            errors.append(f"request {r}: the rank's cache does not hold exactly its shard")
    if seeded_nan:
        written = layer.finite_slots(cache)
        if written != sum(local):
            errors.append(f"{written} slots written on this rank, its shard has {sum(local)}")
    found.update(
        errors=errors, local_seq_lens=local, seeded_nan=seeded_nan, single_rank=want is not None
    )
    if per_rank_sinks and all_sinks is not None:
        found["per_rank_sinks_error"] = _per_rank_sinks_error(
            dcp, step, comm, query[:, heads].to(dev), cache, all_sinks, heads, ref, tokens
        )
    return found


def _per_rank_sinks_error(
    dcp: Any, step: Any, comm: Any, query: torch.Tensor, cache: Any, sinks: torch.Tensor,
    heads: slice, ref: torch.Tensor, tokens: int,
) -> float:  # fmt: skip
    """The error of a wrong DCP merge: the sinks in every rank's kernel, none in the merge."""
    assert dcp.gathered is not None
    wrong_spec = replace(dcp.gathered.spec, use_sinks=True)
    wrong = type(dcp.gathered)(wrong_spec, dcp.gathered.device, emulate=dcp.gathered.emulate)
    impl = wrong.impl(sinks=sinks)
    meta = wrong.metadata_builder().build(step.meta.batch)
    out, lse = impl.forward(comm.gather_heads(query), None, None, cache, meta, return_lse=True)
    merged, _ = comm.combine(out, lse.t(), empty_rows=step.empty_rows)
    return float((merged.to("cpu")[:tokens].double() - ref[:tokens, heads]).abs().max())


def _dcp_rank_main(rank: int, n: int, store: str, results: Any, job: dict[str, Any]) -> None:
    """A rank's run of ``job`` (backend, spec: an AttentionSpec or an MLASpec, device,
    emulate, sub-cases)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=n,
            timeout=timedelta(seconds=60),
        )  # fmt: skip
        from attnhub.context_parallel import AllGatherReduceScatter, AllToAll

        variants = {"all_gather_reduce_scatter": AllGatherReduceScatter, "all_to_all": AllToAll}
        backend_cls = load_backend(job["backend"])
        report = {}
        for i, sub in enumerate(job["sub_cases"]):
            comm = variants[sub.variant]()
            report[sub.id] = dcp_sub_case(
                comm, backend_cls, job["spec"], job["device"], job["emulate"], sub, 100 + i,
                per_rank_sinks=job.get("per_rank_sinks", False),
            )  # fmt: skip
        extra = job.get("extra")
        if extra is not None:
            report["extra"] = load_backend(extra)(rank, n, job)
        dist.destroy_process_group()
        results.put((rank, "ok", report))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_group(n: int, job: dict[str, Any], deadline_s: float = DEADLINE_S) -> dict[int, Any]:
    """Run ``job`` on ``n`` spawned gloo ranks; each rank's report. Kills what still runs at
    the deadline (or on any failure here) and raises with what the ranks said."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_dcp_rank_main, args=(r, n, store, results, job)) for r in range(n)
        ]
        reports: dict[int, Any] = {}
        try:
            for p in procs:
                p.start()
            end = time.monotonic() + deadline_s
            while len(reports) < n:
                try:
                    rank, status, payload = results.get(timeout=1.0)
                except queue.Empty:
                    dead = [
                        r
                        for r, p in enumerate(procs)
                        if p.exitcode is not None and r not in reports
                    ]
                    if dead and results.empty():
                        time.sleep(1.0)  # a report sent just before the exit is on its way
                        if results.empty():
                            raise AssertionError(
                                f"rank(s) {dead} of the {n}-rank group exited without a report "
                                f"(exit codes {[procs[r].exitcode for r in dead]})"
                            ) from None
                    if time.monotonic() > end:
                        raise AssertionError(
                            f"the {n}-rank group did not finish within {deadline_s} s; ranks "
                            f"that reported: {sorted(reports)}"
                        ) from None
                    continue
                if status != "ok":
                    raise AssertionError(f"rank {rank} of {n} failed:\n{payload}")
                reports[rank] = payload
            for p in procs:
                p.join(timeout=30)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
    return reports
