"""The API-boundary fuzz: hypothesis draws a valid step, spoils one thing about it, makes the call
and holds the backend to three rules:

  - it raises only typed errors (``attnhub.errors.AttnhubError``), never anything else;
  - a refused call leaves every cache it was given byte-identical;
  - an accepted call is correct: the output equals ``attnhub.reference`` over the cache the
    reference's own write leaves (within the declared tolerance; padding rows zero), the cache
    holds exactly that write, and a block operation moved exactly the blocks it was asked to.
    A call the reference itself cannot make sense of (a slot outside the cache, metadata built
    for another block size) must not be accepted.

What is spoiled (the fault table's "targets"): lengths, slots, block tables, the common prefix,
dtypes, shapes, devices, strides (of every tensor, the batch's integer tensors included), NaN
and inf values, metadata built for another spec, the output buffer, ``write_kv``'s own slot
mapping, and the arguments of ``copy_blocks`` / ``swap_blocks``. Some spoilings leave a valid
call (a strided view holding the same values, an int32 slot mapping, NaN in one request's
inputs): those must be computed correctly, or refused with a typed error.

Draws are seeded (``seed``) and no example database is kept: a run draws the same examples every
time. Each failure is described with its example number and the seed::

    from attnhub_conformance import fuzz
    report = fuzz.run(backend, examples=300, seed=0)
    print(report.summary()); assert report.ok, report.failures()

Known defects (none today) would be listed in :data:`KNOWN_DEFECTS`: an example
of exactly that kind on exactly that backend that goes wrong is counted as ``known`` (and
named), not as a failure; anything else fails.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from attnhub import AttentionBackend, BatchMetadata, PagedKVCache, testing
from attnhub.errors import AttnhubError
from attnhub.spec import AttentionSpec
from attnhub_conformance.harness import with_tensors
from attnhub_conformance.soak import backend_label

__all__ = ["KNOWN_DEFECTS", "TARGETS", "FuzzReport", "backend_label", "run"]

#: The parts of the API the fuzz spoils, in the order the fault table lists them.
TARGETS = (
    "lengths",
    "slot_mapping",
    "block_table",
    "common_prefix",
    "dtypes",
    "shapes",
    "devices",
    "strides",
    "nan_inf",
    "foreign_meta",
    "output",
    "write_kv",
    "block_ops",
)

#: (backend label pattern, variant) -> why an example of that variant may go wrong there for
#: now: a defect being fixed elsewhere. A label is ``backend.name``, with the flash provider
#: appended (``flash-fa3``); the pattern is an ``fnmatch`` pattern ("*": any). Issue 23's
#: defects 2, 3, 4, 5 and 8, and a query/key/value/output whose last dimension is strided (found
#: by this fuzz: it reached the vendor ops, which raised their own untyped errors; now a core
#: rule), were listed here until their fixes merged (docs/reliability.md).
KNOWN_DEFECTS: dict[tuple[str, str], str] = {}


@dataclass
class FuzzReport:
    """What one fuzz run drew and found. ``ok`` when nothing went wrong (known defects aside)."""

    backend: str
    seed: int
    examples: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TARGETS, 0))
    accepted: int = 0  # calls accepted (and checked)
    typed_errors: int = 0  # calls refused with an attnhub error
    untyped_errors: int = 0  # calls that raised anything else
    corruptions: int = 0  # refused calls that changed a cache
    wrong_results: int = 0  # accepted calls whose output or cache is wrong, or that the
    # reference refuses
    known: int = 0  # examples that went wrong as a known defect says
    variants: dict[str, int] = field(default_factory=dict)  # variant -> examples
    messages: list[str] = field(default_factory=list)  # the first failure of each variant
    failed_variants: dict[str, int] = field(default_factory=dict)  # variant -> failures
    known_seen: dict[str, str] = field(default_factory=dict)  # variant -> defect

    @property
    def total(self) -> int:
        return sum(self.examples.values())

    @property
    def ok(self) -> bool:
        return not (self.untyped_errors or self.corruptions or self.wrong_results)

    def failures(self) -> str:
        return "\n".join(self.messages) or "none"

    def summary(self) -> str:
        per = ", ".join(f"{t} {n}" for t, n in self.examples.items())
        known = ""
        if self.known:
            known = f"; known defects tripped {self.known} ({', '.join(sorted(self.known_seen))})"
        return (
            f"fuzz {self.backend} seed {self.seed}: {self.total} examples ({per}); accepted "
            f"{self.accepted}, typed errors {self.typed_errors}, untyped errors "
            f"{self.untyped_errors}, cache corruptions {self.corruptions}, wrong results "
            f"{self.wrong_results}{known}"
        )


def known_defect(label: str, variant: str) -> str | None:
    """The known defect an example of ``variant`` on the backend ``label`` may trip, if any."""
    for (pattern, known_variant), why in KNOWN_DEFECTS.items():
        if known_variant == variant and fnmatch.fnmatchcase(label, pattern):
            return why
    return None


# --- a valid step ------------------------------------------------------------------------------


@dataclass
class _Base:
    """A valid step: its batch, a cache of finite garbage (slots no request uses hold NaN),
    inputs, and the common prefix it may be built with."""

    batch: BatchMetadata
    cache: PagedKVCache
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    common_prefix_len: int
    requests: list[tuple[int, int]]
    g: torch.Generator


@dataclass
class _Attempt:
    target: str
    variant: str  # e.g. "slot_mapping/strided": the known-defect key
    call: Callable[[], object]
    caches: list[PagedKVCache]  # what a refusal must leave byte-identical
    check: Callable[[object], str | None]  # on acceptance: None when correct, else why


class _Fuzzer:
    def __init__(self, backend: AttentionBackend, report: FuzzReport) -> None:
        self.backend, self.report = backend, report
        self.spec = spec = backend.spec
        self.caps = backend.capabilities
        self.dev = backend.device
        self.label = backend_label(backend)
        self.builder = backend.metadata_builder()
        g = testing.generator(0)
        self.sinks = (
            testing.random_sinks(spec.num_heads, g, device=self.dev) if spec.use_sinks else None
        )
        self.slopes = (
            testing.alibi_slopes(spec.num_heads, device=self.dev) if spec.use_alibi else None
        )
        self.impl = backend.impl(alibi_slopes=self.slopes, sinks=self.sinks)
        tol = testing.capped_tolerance(self.caps.tolerance(spec.dtype), spec.dtype)
        assert tol is not None, f"{backend.name} declares a tolerance looser than the cap"
        self.tol = tol
        self.others = self._other_specs()

    def _other_specs(self) -> dict[str, AttentionSpec]:
        """Specs of the same backend that differ in one geometry field (metadata from
        another layer)."""
        out = {}
        spec = self.spec
        for name, change in (
            ("block_size", {"block_size": spec.block_size * 2}),
            ("block_size_half", {"block_size": spec.block_size // 2}),
            ("head_size", {"head_size": spec.head_size * 2}),
            ("kv_heads", {"num_kv_heads": spec.num_heads}),
        ):
            try:
                other = replace(spec, **change)  # type: ignore[arg-type]
            except AttnhubError:
                continue
            if other.block_size >= 1 and not type(self.backend).unsupported_reasons(other):
                out[name] = other
        return out

    # --- drawing ---
    def draw_base(
        self, data: st.DataObject, *, min_context: int = 0, max_requests: int = 4
    ) -> _Base:
        spec, bs = self.spec, self.spec.block_size
        requests = []
        kinds = ["decode", "chunked", "multi_token"] + ([] if min_context else ["prefill"])
        for _ in range(data.draw(st.integers(1, max_requests), label="requests")):
            kind = data.draw(st.sampled_from(kinds))
            context = (
                0 if kind == "prefill" else data.draw(st.integers(max(1, min_context), 2 * bs + 3))
            )
            q = {
                "decode": 1,
                "prefill": data.draw(st.integers(1, 2 * bs + 3)),
                "chunked": data.draw(st.integers(2, bs + 3)),
                "multi_token": data.draw(st.integers(2, 4)),
            }[kind]
            requests.append((q, context + q))
        threshold = self.builder.reorder_batch_threshold
        if threshold is not None:  # decodes first, as the builder asks
            requests.sort(key=lambda r: r[0] > threshold)
        shortest = min(s - q for q, s in requests)
        shared = 0
        if len(requests) > 1 and shortest >= bs:
            shared = data.draw(st.integers(0, shortest // bs), label="shared prefix blocks")
        padding = data.draw(st.integers(0, 3), label="padding rows")
        g = testing.generator(data.draw(st.integers(0, 2**31 - 1), label="data seed"))
        seq_lens = [s for _, s in requests]
        num_blocks = testing.num_blocks_for(seq_lens, bs, 2, shared_prefix_blocks=shared) + 1
        table = testing.shuffled_block_table(
            seq_lens,
            bs,
            num_blocks,
            g,
            extra_width=1,
            shared_prefix_blocks=shared,
            keep_last_block_free=True,
        )
        n = sum(q for q, _ in requests)
        batch = BatchMetadata.from_lengths(
            [q for q, _ in requests], seq_lens, table, bs, self.dev, num_tokens=n + padding
        )
        cache = self.backend.allocate_kv_cache(num_blocks)
        testing.fill_cache_random(cache, g)
        testing.poison_unused_slots(cache, batch, finite=self.caps.finite_stale_slots)
        query, key, value = testing.random_qkv(spec, n + padding, g, device=self.dev)
        common = shared * bs if self.caps.cascade else 0
        return _Base(batch, cache, query, key, value, common, requests, g)

    # --- what an accepted forward must have done ---
    def forward_attempt(
        self,
        base: _Base,
        target: str,
        variant: str,
        *,
        batch: BatchMetadata | None = None,
        query: Any = None,
        key: Any = "base",
        value: Any = "base",
        common_prefix_len: int | None = None,
        builder: Any = None,
        output: Any = None,
        skip_rows: torch.Tensor | None = None,  # [n] bool: rows whose output is not compared
    ) -> _Attempt:
        batch = base.batch if batch is None else batch
        query = base.query if query is None else query
        key = base.key if isinstance(key, str) else key
        value = base.value if isinstance(value, str) else value
        cpl = base.common_prefix_len if common_prefix_len is None else common_prefix_len
        builder = self.builder if builder is None else builder
        cache = base.cache
        before = cache.clone()
        impl = self.impl

        def call() -> object:
            meta = builder.build(batch, common_prefix_len=cpl)
            if output is None:
                return impl.forward(query, key, value, cache, meta)
            return impl.forward(query, key, value, cache, meta, output=output)

        def check(out: object) -> str | None:
            try:
                want_cache, want = testing.reference_after_write(
                    self.spec,
                    before,
                    batch,
                    _plain(query),
                    None if key is None else _plain(key),
                    None if value is None else _plain(value),
                    alibi_slopes=self.slopes,
                    sinks=self.sinks,
                )
            except Exception as exc:
                return f"accepted a call attnhub.reference refuses ({type(exc).__name__}: {exc})"
            shape = (query.shape[0], self.spec.num_heads, self.spec.head_size_v)
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape:
                return f"returned {_describe(out)}, expected a tensor of shape {list(shape)}"
            if output is not None and out is not output:
                return "forward(output=buf) returned another tensor than buf"
            n = batch.num_actual_tokens
            got = out.detach().to("cpu", torch.float64)
            rows = torch.ones(n, dtype=torch.bool) if skip_rows is None else ~skip_rows
            why = testing.mismatch(got[:n][rows], want[rows], self.tol)
            if why is not None:
                return f"output differs from attnhub.reference: {why}"
            if not bool((got[n:] == 0).all()):
                return f"padding rows {n}..{got.shape[0] - 1} are not zero"
            if key is not None:
                problems = testing.cache_differences(cache, want_cache, batch.slot_mapping)
                if problems:
                    return "the cache is wrong: " + "; ".join(problems)
            elif not cache.equal(before):
                return "forward(key=None) changed the cache"
            return None

        return _Attempt(target, variant, call, [cache], check)

    # --- one example ---
    def example(self, data: st.DataObject, target: str, number: int) -> None:
        # a common prefix needs cached context in every request; a one-request step is where
        # a strided length tensor looks contiguous
        base = self.draw_base(
            data,
            min_context=self.spec.block_size if target == "common_prefix" else 0,
            max_requests=2 if target == "strides" else 4,
        )
        attempt = getattr(self, "spoil_" + target)(data, base)
        self.report.examples[target] += 1
        self.report.variants[attempt.variant] = self.report.variants.get(attempt.variant, 0) + 1
        snapshots = [c.clone() for c in attempt.caches]
        problem: str | None = None
        try:
            result = attempt.call()
        except AttnhubError as exc:
            self.report.typed_errors += 1
            if not str(exc).strip():
                problem = f"{type(exc).__name__} raised without a message"
            changed = [
                i
                for i, (c, s) in enumerate(zip(attempt.caches, snapshots, strict=True))
                if not c.equal(s)
            ]
            if changed:
                self._failed(
                    attempt, number, "corruption", f"refused ({exc}) after changing the cache"
                )
                return
        except Exception as exc:
            self.report.untyped_errors += 1
            self._failed(attempt, number, "untyped", f"raised {type(exc).__name__}: {exc}".strip())
            return
        else:
            self.report.accepted += 1
            problem = attempt.check(result)
        if problem is not None:
            self._failed(attempt, number, "wrong", problem)

    def _failed(self, attempt: _Attempt, number: int, kind: str, why: str) -> None:
        known = known_defect(self.label, attempt.variant)
        r = self.report
        if known is not None:
            r.known += 1
            r.known_seen[attempt.variant] = known
            if kind == "untyped":
                r.untyped_errors -= 1
                if "after changing the cache" in why:
                    r.corruptions -= 1
            return
        if kind == "corruption":
            r.corruptions += 1
        elif kind == "wrong":
            r.wrong_results += 1
        first = attempt.variant not in r.failed_variants
        r.failed_variants[attempt.variant] = r.failed_variants.get(attempt.variant, 0) + 1
        if first and len(r.messages) < 20:
            r.messages.append(f"example {number} (seed {r.seed}) {attempt.variant}: {why[:600]}")

    # --- the spoilers, one per target ---
    def spoil_lengths(self, data: st.DataObject, base: _Base) -> _Attempt:
        b = base.batch
        r = data.draw(st.integers(0, b.num_reqs - 1))
        q = b.query_lens_cpu
        seq = b.seq_lens_cpu.clone()
        qsl = b.query_start_loc_cpu.clone()
        how = data.draw(
            st.sampled_from(
                [
                    "seq_below_query",
                    "seq_past_table",
                    "seq_negative",
                    "qsl_decreasing",
                    "qsl_past_tokens",
                ]
            )
        )
        if how == "seq_below_query":
            seq[r] = data.draw(st.integers(0, max(int(q[r]) - 1, 0)))
        elif how == "seq_past_table":
            seq[r] = b.block_table.shape[1] * b.block_size + data.draw(st.integers(1, 50))
        elif how == "seq_negative":
            seq[r] = -data.draw(st.integers(1, 10**6))
        elif how == "qsl_decreasing":
            qsl[r + 1] = qsl[r] - data.draw(st.integers(1, 3))
        else:
            qsl[-1] = b.num_tokens + data.draw(st.integers(1, 5))
        batch = replace(
            b,
            query_start_loc=qsl.to(b.device),
            query_start_loc_cpu=qsl,
            seq_lens=seq.to(b.device),
            seq_lens_cpu=seq,
        )
        return self.forward_attempt(base, "lengths", f"lengths/{how}", batch=batch)

    def spoil_slot_mapping(self, data: st.DataObject, base: _Base) -> _Attempt:
        b = base.batch
        slots = b.slot_mapping.clone()
        how = data.draw(
            st.sampled_from(["outside", "below_padding", "int32", "float", "short", "strided"])
        )
        batch = b
        if how in ("outside", "below_padding"):
            # the last real token or a padding row: earlier tokens stay valid, so a backend
            # that writes before it checks changes the cache
            i = data.draw(st.integers(max(b.num_actual_tokens - 1, 0), b.num_tokens - 1))
            n_slots = base.cache.num_slots
            slots[i] = (
                data.draw(st.integers(n_slots, n_slots + 1000))
                if how == "outside"
                else -data.draw(st.integers(2, 1000))
            )
            batch = with_tensors(b, slot_mapping=slots)
        elif how == "int32":
            batch = with_tensors(b, slot_mapping=slots.to(torch.int32))
        elif how == "float":
            batch = with_tensors(b, slot_mapping=slots.to(torch.float32))
        elif how == "short":
            batch = with_tensors(b, slot_mapping=slots[: b.num_actual_tokens - 1])
        else:
            batch = with_tensors(b, slot_mapping=_strided(slots))
        return self.forward_attempt(base, "slot_mapping", f"slot_mapping/{how}", batch=batch)

    def spoil_block_table(self, data: st.DataObject, base: _Base) -> _Attempt:
        b = base.batch
        table = b.block_table.clone()
        how = data.draw(
            st.sampled_from(["outside", "negative", "unused_entry", "int64", "one_d", "strided"])
        )
        batch = b
        used = [math.ceil(s / b.block_size) for _, s in base.requests]
        r = data.draw(st.integers(0, b.num_reqs - 1))
        if how in ("outside", "negative"):
            c = data.draw(st.integers(0, used[r] - 1))
            table[r, c] = (
                data.draw(st.integers(base.cache.num_blocks, base.cache.num_blocks + 100))
                if how == "outside"
                else -data.draw(st.integers(1, 100))
            )
            batch = with_tensors(b, block_table=table)
        elif how == "unused_entry":  # a column past the request's blocks: any value is valid
            table[r, used[r] :] = data.draw(st.integers(0, 2**31 - 1))
            batch = with_tensors(b, block_table=table)
        elif how == "int64":
            batch = with_tensors(b, block_table=table.to(torch.int64))
        elif how == "one_d":
            batch = with_tensors(b, block_table=table.flatten())
        else:
            batch = with_tensors(b, block_table=_strided(table))
        return self.forward_attempt(base, "block_table", f"block_table/{how}", batch=batch)

    def spoil_common_prefix(self, data: st.DataObject, base: _Base) -> _Attempt:
        b = base.batch
        bs = b.block_size
        shortest = int(b.context_lens_cpu.min())
        how = data.draw(st.sampled_from(["blocks", "blocks", "tokens", "negative", "past_context"]))
        if how == "blocks":  # whole blocks within every context: the usual value
            value = bs * data.draw(st.integers(1, max(shortest // bs, 1)))
        elif how == "tokens":
            value = data.draw(st.integers(1, shortest))
        elif how == "negative":
            value = -data.draw(st.integers(1, 3))
        else:
            value = shortest + data.draw(st.integers(1, 2 * bs))
        table = b.host_block_table()
        blocks = max(value, 0) // bs
        consistent = bool((table[:, :blocks] == table[:1, :blocks]).all())
        variant = "common_prefix/" + (
            "negative"
            if value < 0
            else "past_context"
            if value > shortest
            else "consistent"
            if consistent
            else "inconsistent"
        )
        return self.forward_attempt(base, "common_prefix", variant, common_prefix_len=value)

    def spoil_dtypes(self, data: st.DataObject, base: _Base) -> _Attempt:
        which = data.draw(st.sampled_from(["query", "key", "value"]))
        dtype = data.draw(
            st.sampled_from(
                [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32]
            )
        )
        tensor = getattr(base, which).to(dtype)
        return self.forward_attempt(base, "dtypes", f"dtypes/{which}", **{which: tensor})

    def spoil_shapes(self, data: st.DataObject, base: _Base) -> _Attempt:
        which = data.draw(st.sampled_from(["query", "key", "value"]))
        t = getattr(base, which)
        how = data.draw(
            st.sampled_from(["fewer_rows", "heads", "head_size", "two_d", "list", "none"])
        )
        spoiled: Any
        if how == "fewer_rows":
            spoiled = t[: base.batch.num_actual_tokens - 1]
        elif how == "heads":
            spoiled = torch.cat([t, t], dim=1)
        elif how == "head_size":
            spoiled = t[..., : t.shape[-1] // 2]
        elif how == "two_d":
            spoiled = t.flatten(1)
        elif how == "list":
            spoiled = t.tolist()
        else:
            spoiled = None
        if which == "query" and spoiled is None:
            spoiled = t[:0]
        return self.forward_attempt(base, "shapes", f"shapes/{which}/{how}", **{which: spoiled})

    def spoil_devices(self, data: st.DataObject, base: _Base) -> _Attempt:
        which = data.draw(st.sampled_from(["query", "key", "value", "output", "batch"]))
        other = "meta" if self.dev.type != "meta" else "cpu"
        if which == "output":
            return self.forward_attempt(
                base, "devices", "devices/output", output=torch.empty_like(base.query, device=other)
            )
        if which == "batch":
            b = base.batch
            batch = replace(
                b, seq_lens=b.seq_lens.to(other), query_start_loc=b.query_start_loc.to(other)
            )
            return self.forward_attempt(base, "devices", "devices/batch", batch=batch)
        return self.forward_attempt(
            base, "devices", f"devices/{which}", **{which: getattr(base, which).to(other)}
        )

    def spoil_strides(self, data: st.DataObject, base: _Base) -> _Attempt:
        which = data.draw(
            st.sampled_from(
                [
                    "query",
                    "key",
                    "value",
                    "seq_lens",
                    "query_start_loc",
                    "block_table",
                    "slot_mapping",
                ]
            )
        )
        if which in ("query", "key", "value"):
            # rows strided as in a fused QKV projection's split (valid: must be computed), or the
            # last dimension strided (a typed refusal before any write)
            last = data.draw(st.booleans())
            view = _strided(getattr(base, which)) if last else _row_strided(getattr(base, which))
            variant = f"strides/{which}" + ("/last_dim" if last else "")
            spoiled: dict[str, Any] = {which: view}
            return self.forward_attempt(base, "strides", variant, **spoiled)
        b = base.batch
        changes: dict[str, Any] = {which: _strided(getattr(b, which))}
        if which in ("seq_lens", "query_start_loc"):
            changes[which + "_cpu"] = _strided(getattr(b, which + "_cpu"))
        variant = f"strides/{which}"
        if which in ("seq_lens", "query_start_loc") and b.num_reqs == 1:
            variant += "/one_request"
        return self.forward_attempt(base, "strides", variant, batch=replace(b, **changes))

    def spoil_nan_inf(self, data: st.DataObject, base: _Base) -> _Attempt:
        which = data.draw(st.sampled_from(["query", "key", "value"]))
        bad = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        b = base.batch
        r = data.draw(st.integers(0, b.num_reqs - 1))
        qsl = b.query_start_loc_cpu.tolist()
        t = getattr(base, which).clone()
        row = data.draw(st.integers(qsl[r], qsl[r + 1] - 1))
        t[row, data.draw(st.integers(0, t.shape[1] - 1)), 0] = bad
        # every row of request r (and, for keys and values, any request reading its blocks:
        # none, as no request shares a block past the common prefix) may be non-finite
        skip = torch.zeros(b.num_actual_tokens, dtype=torch.bool)
        skip[qsl[r] : qsl[r + 1]] = True
        return self.forward_attempt(
            base, "nan_inf", f"nan_inf/{which}", **{which: t}, skip_rows=skip
        )

    def spoil_foreign_meta(self, data: st.DataObject, base: _Base) -> _Attempt:
        if not self.others:
            return self.forward_attempt(base, "foreign_meta", "foreign_meta/none")
        name = data.draw(st.sampled_from(sorted(self.others)))
        other = self.others[name]
        backend = type(self.backend)(other, self.dev, emulate=self.backend.emulate)
        b = base.batch
        seq_lens = [s for _, s in base.requests]
        try:  # block ids of this cache where they suffice
            table = testing.shuffled_block_table(
                seq_lens, other.block_size, base.cache.num_blocks, base.g
            )
        except ValueError:
            num_blocks = testing.num_blocks_for(seq_lens, other.block_size)
            table = testing.shuffled_block_table(seq_lens, other.block_size, num_blocks, base.g)
        batch = BatchMetadata.from_lengths(
            b.query_lens_cpu,
            b.seq_lens_cpu,
            table,
            other.block_size,
            self.dev,
            num_tokens=b.num_tokens,
        )
        attempt = self.forward_attempt(
            base,
            "foreign_meta",
            f"foreign_meta/{name}",
            batch=batch,
            builder=backend.metadata_builder(),
            common_prefix_len=0,
        )
        # metadata belongs to the layer it was built for: another spec's is refused, even
        # where this step would come out right
        return replace(attempt, check=lambda out: f"accepted metadata built for {other}")

    def spoil_output(self, data: st.DataObject, base: _Base) -> _Attempt:
        how = data.draw(st.sampled_from(["dtype", "rows", "strided", "list"]))
        q = base.query
        out: Any = {
            "dtype": lambda: torch.empty(q.shape, dtype=torch.float32, device=q.device),
            "rows": lambda: torch.empty_like(q)[:-1],
            "strided": lambda: _strided(torch.empty_like(q)),
            "list": lambda: [],
        }[how]()
        return self.forward_attempt(base, "output", f"output/{how}", output=out)

    def spoil_write_kv(self, data: st.DataObject, base: _Base) -> _Attempt:
        b, cache = base.batch, base.cache
        slots = b.slot_mapping.clone()
        how = data.draw(
            st.sampled_from(["valid", "strided", "outside", "float", "duplicate", "int32"])
        )
        if how == "strided":
            slots = _strided(slots)
        elif how == "outside":
            slots[data.draw(st.integers(0, slots.numel() - 1))] = cache.num_slots + data.draw(
                st.integers(0, 99)
            )
        elif how == "float":
            slots = slots.to(torch.float32)
        elif how == "duplicate" and b.num_actual_tokens > 1:
            slots[1] = slots[0]
        elif how == "int32":
            slots = slots.to(torch.int32)
        before = cache.clone()
        impl, key, value = self.impl, base.key, base.value

        def call() -> object:
            impl.write_kv(key, value, cache, slots)
            return None

        def check(_: object) -> str | None:
            try:
                want = testing.cache_after_write(before, key, value, _plain_slots(slots, cache))
            except Exception as exc:
                return f"accepted a write attnhub.reference refuses ({type(exc).__name__}: {exc})"
            problems = testing.cache_differences(cache, want, slots.to("cpu").long())
            return "the cache is wrong: " + "; ".join(problems) if problems else None

        return _Attempt("write_kv", f"write_kv/{how}", call, [cache], check)

    def spoil_block_ops(self, data: st.DataObject, base: _Base) -> _Attempt:
        cache = base.cache
        swap = data.draw(st.booleans(), label="swap")
        n_src = cache.num_blocks
        dst_cache = cache.empty_like(data.draw(st.integers(1, 6)), "cpu") if swap else cache
        n_dst = dst_cache.num_blocks
        how = data.draw(
            st.sampled_from(
                [
                    "valid",
                    "valid_tensor",
                    "int32",
                    "strided",
                    "empty",
                    "outside",
                    "negative",
                    "float",
                    "three_columns",
                    "one_d",
                    "none",
                    "planes",
                    "strings",
                ]
            )
        )
        count = data.draw(st.integers(1, min(n_src, n_dst, 4)))
        src = data.draw(st.lists(st.integers(0, n_src - 1), min_size=count, max_size=count))
        dst = data.draw(
            st.lists(st.integers(0, n_dst - 1), min_size=count, max_size=count, unique=True)
        )
        pairs = [[s, d] for s, d in zip(src, dst, strict=True)]
        arg: Any = {
            "valid": lambda: pairs,
            "valid_tensor": lambda: torch.tensor(pairs),
            "int32": lambda: torch.tensor(pairs, dtype=torch.int32),
            "strided": lambda: _strided(torch.tensor(pairs)),
            "empty": lambda: [],
            "outside": lambda: [*pairs, [n_src + 3, 0]],
            "negative": lambda: [[-1, dst[0]]],
            "float": lambda: torch.tensor(pairs, dtype=torch.float32),
            "three_columns": lambda: [[s, d, 0] for s, d in pairs],
            "one_d": lambda: src,
            "none": lambda: None,
            "planes": lambda: (cache.key, cache.value),
            "strings": lambda: [["0", "1"]],
        }[how]()
        target_cache: Any = dst_cache
        if swap:
            wrong_dst = data.draw(st.sampled_from(["good", "good", "none", "tuple", "other_dtype"]))
            if wrong_dst == "none":
                target_cache = None
            elif wrong_dst == "tuple":
                target_cache = (dst_cache.key, dst_cache.value)
            elif wrong_dst == "other_dtype":
                target_cache = (
                    replace(dst_cache, key=dst_cache.key.float(), value=dst_cache.value.float())
                    if dst_cache.key.dtype != torch.float32
                    else replace(dst_cache, key=dst_cache.key.half(), value=dst_cache.value.half())
                )
            if wrong_dst != "good":
                how = f"dst_{wrong_dst}"  # whatever the mapping: the destination is wrong
        before_src, before_dst = cache.clone(), dst_cache.clone()

        def call() -> object:
            if swap:
                cache.swap_blocks(target_cache, arg)
            else:
                cache.copy_blocks(arg)
            return None

        def check(_: object) -> str | None:
            if target_cache is not dst_cache:
                return f"accepted {_describe(target_cache)} as the destination cache"
            m = _plain_mapping(arg, n_src, n_dst)
            if m is None:
                return f"accepted block_mapping {_describe(arg)}"
            want = before_dst.clone() if swap else before_src.clone()
            for name, plane in want.planes().items():
                plane[m[:, 1]] = before_src.planes()[name][m[:, 0]].to(plane.device)
            if not dst_cache.equal(want):
                return "the destination blocks hold other data than the sources'"
            if swap and not cache.equal(before_src):
                return "swap_blocks changed its source cache"
            return None

        op = "swap_blocks" if swap else "copy_blocks"
        caches = [cache, dst_cache] if swap else [cache]
        return _Attempt("block_ops", f"{op}/{how}", call, caches, check)


# --- helpers -----------------------------------------------------------------------------------


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a view every other element of a larger buffer (last dim)."""
    wide = torch.zeros(
        (*t.shape[:-1], 2 * t.shape[-1]) if t.dim() else (2,), dtype=t.dtype, device=t.device
    )
    view = wide[..., ::2] if t.dim() else wide[::2]
    view.copy_(t if t.dim() else t.reshape(1))
    return view if t.dim() else view.reshape(())


def _row_strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a view whose rows (first dimension) lie twice their width apart, the
    rest dense: what splitting a fused ``[T, (H + 2 * Hkv) * D]`` QKV projection gives."""
    width = t[0].numel() if t.shape[0] else 1
    wide = torch.zeros((t.shape[0], 2 * width), dtype=t.dtype, device=t.device)
    view = wide[:, :width].view(t.shape)
    view.copy_(t)
    return view


def _plain(t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"not a tensor: {type(t).__name__}")
    return t.detach().to("cpu")


def _plain_slots(slots: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
    """The slot mapping as the reference reads it: integers, -1 or inside the cache, distinct."""
    if slots.is_floating_point():
        raise TypeError(f"slot_mapping of dtype {slots.dtype}")
    s = slots.to("cpu").long()
    if bool(((s < -1) | (s >= cache.num_slots)).any()):
        raise IndexError("a slot outside the cache")
    real = s[s >= 0]
    if real.unique().numel() != real.numel():
        raise ValueError("two tokens written to one slot")
    return s


def _plain_mapping(arg: Any, n_src: int, n_dst: int) -> torch.Tensor | None:
    """``arg`` as [n, 2] (src, dst) block pairs inside both caches, or None."""
    if not isinstance(arg, (torch.Tensor, list)):
        return None
    try:
        m = torch.as_tensor(arg)
    except Exception:
        return None
    if m.numel() == 0:
        return m.reshape(0, 2).long()
    if m.is_floating_point() or m.is_complex() or m.dtype == torch.bool:
        return None
    if m.dim() != 2 or m.shape[1] != 2:
        return None
    m = m.long()
    if bool(((m[:, 0] < 0) | (m[:, 0] >= n_src) | (m[:, 1] < 0) | (m[:, 1] >= n_dst)).any()):
        return None
    return m


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {list(x.shape)}"
    return type(x).__name__


# --- the run -----------------------------------------------------------------------------------


def run(backend: AttentionBackend, examples: int, seed: int = 0) -> FuzzReport:
    """Fuzz ``backend`` (an instance bound to a spec and a device) with about ``examples``
    examples drawn from ``seed``, shared evenly between the targets (one seeded hypothesis run
    each: every target is spoiled as often as the others)."""
    report = FuzzReport(backend_label(backend), seed)
    fuzzer = _Fuzzer(backend, report)
    counter = iter(range(10**9))
    per_target = max(1, math.ceil(examples / len(TARGETS)))
    for target in TARGETS:
        _run_target(fuzzer, target, per_target, testing.seed_of(f"{seed}/{target}"), counter)
    return report


def _run_target(
    fuzzer: _Fuzzer, target: str, examples: int, seed: int, counter: Iterator[int]
) -> None:
    @hypothesis_seed(seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def one(data: st.DataObject) -> None:
        fuzzer.example(data, target, next(counter))

    one()
