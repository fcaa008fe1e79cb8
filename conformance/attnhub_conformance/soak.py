"""The soak: a mini engine drives one backend through thousands of random steps and checks every
output against a shadow float64 model of every request's keys and values.

The engine is a small scheduler of the kind vLLM runs, over one layer's paged cache:
  - requests arrive with prompts of random length and are admitted while blocks are free;
    blocks are allocated as sequences grow and freed when they finish;
  - prompts are prefilled in chunks (chunked prefill) next to decodes of other requests;
  - decodes take one token, or several (multi-token decode: the last token and drafts), after
    which a random number of drafts is rejected and the sequence rolls back;
  - when blocks run out, a running request is preempted: by recompute (its blocks freed, its
    tokens prefilled again later) or by swap (its blocks copied to a host swap space with
    ``swap_blocks`` and back when it resumes);
  - a new request may fork from a running one and share its blocks (a shared prefix); a shared
    block is copied (``copy_blocks``, copy-on-write) before either request writes into it;
  - steps whose requests share leading blocks go with ``common_prefix_len`` (cascade) where the
    backend declares cascade;
  - steps carry padding rows (slot -1) of finite garbage;
  - every freed block is poisoned with NaN (a far-off finite value for a backend that declares
    ``finite_stale_slots``), so a backend that reads a block it was not given returns garbage.

The shadow model holds, per request, the keys and values of every position as the cache must
store them (float64 of the spec's dtype). Every step's output is compared with
``attnhub.reference.attention`` over the shadow (not over the cache: a write to the wrong block
that the backend then reads back consistently still differs), within the backend's declared
tolerance; every ``check_every`` steps the cache (and the swap space) must hold exactly the
shadow's values for every live request. Memory is measured after a warm-up and at the end.

Everything random comes from one seed; a failure names the step and the seed, and rerunning
with the same seed and at least that many steps fails the same way::

    from attnhub_conformance import soak
    report = soak.run(backend, steps=2000, seed=7)    # backend: an AttentionBackend instance
    print(report.summary()); assert report.ok, report.failures()

``python -m attnhub_conformance.soak --backend NAME --steps 10000 [--emulate]`` runs it from the
command line (``nox -s soak`` runs it for every in-repo backend and prints the figures).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import attnhub
from attnhub import AttentionBackend, AttentionSpec, BatchMetadata, PagedKVCache, testing
from attnhub.cli import torch_device
from attnhub.errors import AttnhubError, NoBackendError
from attnhub.reference import attention

__all__ = ["SoakReport", "backend_label", "default_spec", "fault_table", "main", "run"]


@dataclass
class SoakReport:
    """What one soak did and found. ``ok`` when nothing was wrong."""

    backend: str
    spec: str
    seed: int
    steps: int = 0  # layer steps run: engine steps that scheduled work, the drains' included
    tokens: int = 0  # query tokens attended (padding rows not counted)
    kv_writes: int = 0  # keys/values written (= tokens)
    requests_finished: int = 0
    chunked_prefills: int = 0  # prefill chunks with cached context
    multi_token_decodes: int = 0
    rejected_drafts: int = 0
    preempted_recompute: int = 0
    preempted_swap: int = 0
    forks: int = 0  # requests admitted sharing a running request's blocks
    copy_on_write: int = 0  # blocks copied before a write into a shared one
    cascade_steps: int = 0  # steps built with common_prefix_len > 0
    padding_rows: int = 0
    poisoned_blocks: int = 0  # frees (each freed block filled with NaN)
    cache_checks: int = 0  # live requests whose cached keys/values were compared with the shadow
    divergences: int = 0  # steps whose output left the declared tolerance
    corruptions: int = 0  # cache checks that found other values than the shadow's
    typed_errors: int = 0  # valid steps refused with an attnhub error (a failure too)
    untyped_errors: int = 0  # valid steps that raised anything else
    rss_growth_mib: float = 0.0  # resident memory after the warm-up -> at the end
    tensor_growth_mib: float = 0.0  # memory of live tensors after the warm-up -> at the end
    seconds: float = 0.0
    messages: list[str] = field(default_factory=list)  # the first failures, in words

    @property
    def ok(self) -> bool:
        return not (
            self.divergences or self.corruptions or self.typed_errors or self.untyped_errors
        )

    def failures(self) -> str:
        """The first failures, one per line, each naming its step and the seed."""
        return "\n".join(self.messages) or "none"

    def summary(self) -> str:
        return (
            f"soak {self.backend} [{self.spec}] seed {self.seed}: {self.steps} steps, "
            f"{self.tokens} tokens, {self.requests_finished} requests finished, "
            f"{self.preempted_recompute}+{self.preempted_swap} preemptions (recompute+swap), "
            f"{self.forks} forks, {self.copy_on_write} copy-on-write, {self.cascade_steps} cascade "
            f"steps, {self.chunked_prefills} chunked prefills, "
            f"{self.multi_token_decodes} multi-token decodes, "
            f"{self.rejected_drafts} drafts rejected, {self.padding_rows} padding rows, "
            f"{self.cache_checks} cache checks; divergences {self.divergences}, "
            f"corruptions {self.corruptions}, typed/untyped errors {self.typed_errors}/"
            f"{self.untyped_errors}; memory growth after warm-up: RSS "
            f"{self.rss_growth_mib:+.1f} MiB, tensors {self.tensor_growth_mib:+.2f} MiB; "
            f"{self.seconds:.1f} s"
        )


def default_spec(backend: type[AttentionBackend]) -> AttentionSpec:
    """A small decoder spec the backend serves: the first of its declared dtypes in the order
    bf16, fp16, fp32, 8 query heads over 2 kv heads (GQA), head size 64 where it can (else its
    smallest), the smallest declared block size of at least 16 (else the first multiple of the
    declared multiple), an unquantized cache, no optional feature."""
    caps = backend.capabilities
    dtype = next(d for d in (torch.bfloat16, torch.float16, torch.float32) if d in caps.dtypes)
    head_sizes = [64, 128, 32, 80, 96, 256] if caps.head_sizes is None else sorted(caps.head_sizes)
    block_sizes = (
        sorted(caps.block_sizes)
        if caps.block_sizes is not None
        else [16 * caps.block_size_multiple // math.gcd(16, caps.block_size_multiple)]
    )
    tried = []
    for head_size in ([64] if 64 in head_sizes else []) + head_sizes:
        for block_size in [b for b in block_sizes if b >= 16] + block_sizes:
            spec = AttentionSpec(
                num_heads=8, num_kv_heads=2, head_size=head_size, dtype=dtype, block_size=block_size
            )
            reasons = backend.unsupported_reasons(spec)
            if not reasons:
                return spec
            tried.append(f"{spec}: {'; '.join(reasons)}")
    raise attnhub.errors.UnsupportedConfigurationError(backend.name, tried[:3])


# --- the engine --------------------------------------------------------------------------------


@dataclass
class _Request:
    rid: int
    family: int  # the request it forked from, transitively (its own id if none)
    key: torch.Tensor  # [len, Hkv, D] float64: every position's key as the cache must hold it
    value: torch.Tensor
    prompt_len: int
    max_len: int
    computed: int = 0  # positions whose keys/values are in the cache (or the swap space)
    blocks: list[int] = field(default_factory=list)  # device blocks (host ones while swapped)
    swapped: bool = False

    @property
    def known(self) -> int:
        return int(self.key.shape[0])


class _Blocks:
    """A pool of block ids with reference counts (shared prefixes); block 0 is never handed out
    (it pads block tables)."""

    def __init__(self, num_blocks: int, rng: random.Random) -> None:
        self.free = list(range(1, num_blocks))
        rng.shuffle(self.free)  # block ids in no order: a backend assuming order fails
        self.refs = [0] * num_blocks

    def take(self) -> int:
        b = self.free.pop()
        self.refs[b] = 1
        return b

    def share(self, b: int) -> None:
        self.refs[b] += 1

    def drop(self, b: int) -> bool:
        """One reference less; True when the block is free again."""
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self.free.insert(0, b)  # reused last: stale NaN stays around for a while
            return True
        return False


class _Engine:
    def __init__(
        self,
        backend: AttentionBackend,
        report: SoakReport,
        *,
        seed: int,
        num_blocks: int,
        swap_blocks: int,
        max_running: int,
        token_budget: int,
    ) -> None:
        self.backend, self.report, self.seed = backend, report, seed
        self.spec = spec = backend.spec
        self.caps = backend.capabilities
        self.dev = backend.device
        self.bs = spec.block_size
        self.rng = random.Random(seed)
        self.gen = testing.generator(seed)
        self.builder = backend.metadata_builder()
        self.sinks = (
            testing.random_sinks(spec.num_heads, self.gen, device=self.dev)
            if spec.use_sinks
            else None
        )
        self.slopes = (
            testing.alibi_slopes(spec.num_heads, device=self.dev) if spec.use_alibi else None
        )
        self.impl = backend.impl(alibi_slopes=self.slopes, sinks=self.sinks)
        self.cache = backend.allocate_kv_cache(num_blocks)
        self.swap = self.cache.empty_like(swap_blocks, "cpu")
        self.blocks = _Blocks(num_blocks, self.rng)
        self.swap_free = list(range(swap_blocks))
        self.max_running, self.token_budget = max_running, token_budget
        tol = testing.capped_tolerance(self.caps.tolerance(spec.dtype), spec.dtype)
        assert tol is not None, f"{backend.name} declares a tolerance looser than the cap"
        self.tol = tol
        self.running: list[_Request] = []
        self.waiting: list[_Request] = []  # preempted by recompute, or swapped out
        self.next_id = 0
        self.step_no = 0
        for b in range(num_blocks):
            self._poison(self.cache, b)
        self.report.poisoned_blocks = 0

    # --- randomness ---
    def _kv(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:  # [n, Hkv, D] f64 of dtype values
        k, v = testing.random_kv(self.spec, n, self.gen)
        return k.double(), v.double()

    def _poison(self, cache: PagedKVCache, b: int) -> None:
        # NaN, or a far-off finite value where the backend declares finite_stale_slots (its
        # kernels mask the scores past seq_len but multiply the tail's values by 0)
        stale = testing.FINITE_POISON if self.caps.finite_stale_slots else float("nan")
        with cache.edit() as plain:  # packed blocks: the logical planes, packed back after
            plain.key_nhd()[b] = stale
            plain.value_nhd()[b] = stale
        self.report.poisoned_blocks += 1

    def _fail(self, what: str) -> None:
        if len(self.report.messages) < 8:
            self.report.messages.append(f"step {self.step_no} (seed {self.seed}): {what}")

    # --- admission ---
    def _admit(self) -> None:
        bs = self.bs
        while len(self.running) < self.max_running:
            if self.waiting:
                req = self.waiting[0]
                if not self._resume(req):
                    return
                self.waiting.pop(0)
                self.running.append(req)
                continue
            if self.rng.random() < 0.35:
                return  # no new arrival this step
            parent = [r for r in self.running if not r.swapped and r.computed >= 1]
            if parent and self.caps.chunked_prefill and self.rng.random() < 0.3:
                # a fork prefills its own tokens after the shared context: a chunked prefill
                self._fork(self.rng.choice(parent))
                continue
            prompt = self.rng.choice([1, self.rng.randint(2, bs), self.rng.randint(bs, 3 * bs + 5)])
            if len(self.blocks.free) < math.ceil(prompt / bs) + 2:
                return
            k, v = self._kv(prompt)
            gen_len = self.rng.randint(1, GENERATED)
            self.running.append(
                _Request(self.next_id, self.next_id, k, v, prompt, prompt + gen_len)
            )
            self.next_id += 1

    def _fork(self, parent: _Request) -> None:
        """A new request whose first ``parent.computed`` positions are the parent's: it shares
        every block of them (the last one perhaps partly: copy-on-write later)."""
        shared = parent.computed
        extra = self.rng.randint(1, self.bs + 3)
        k, v = self._kv(extra)
        child = _Request(
            self.next_id,
            parent.family,
            torch.cat([parent.key[:shared], k]),
            torch.cat([parent.value[:shared], v]),
            shared + extra,
            shared + extra + self.rng.randint(1, GENERATED),
            computed=shared,
        )
        child.blocks = parent.blocks[: math.ceil(shared / self.bs)]
        for b in child.blocks:
            self.blocks.share(b)
        self.next_id += 1
        self.running.append(child)
        self.report.forks += 1

    def _resume(self, req: _Request) -> bool:
        """Back from preemption: a swapped request's blocks come back from the swap space; a
        recomputed one starts again from position 0 (its prompt is every known position)."""
        if not req.swapped:
            return len(self.blocks.free) >= math.ceil(req.known / self.bs) + 1
        if len(self.blocks.free) < len(req.blocks) + 1:
            return False
        dev_blocks = [self.blocks.take() for _ in req.blocks]
        self.swap.swap_blocks(
            self.cache, [[h, d] for h, d in zip(req.blocks, dev_blocks, strict=True)]
        )
        for h in req.blocks:
            self._poison(self.swap, h)
            self.swap_free.append(h)
        req.blocks, req.swapped = dev_blocks, False
        return True

    # --- preemption ---
    def _preempt(self, victim: _Request) -> None:
        self.running.remove(victim)
        exclusive = all(self.blocks.refs[b] == 1 for b in victim.blocks)
        if exclusive and len(self.swap_free) >= len(victim.blocks) and self.rng.random() < 0.5:
            host = [self.swap_free.pop() for _ in victim.blocks]
            self.cache.swap_blocks(
                self.swap, [[d, h] for d, h in zip(victim.blocks, host, strict=True)]
            )
            for d in victim.blocks:
                self.blocks.drop(d)
                self._poison(self.cache, d)
            victim.blocks, victim.swapped = host, True
            self.report.preempted_swap += 1
        else:
            self._release(victim)
            victim.computed = 0
            victim.prompt_len = max(victim.prompt_len, victim.known)  # recompute every position
            self.report.preempted_recompute += 1
        self.waiting.append(victim)

    def _release(self, req: _Request, keep: int = 0) -> None:
        """Drop the request's blocks past its first ``keep`` (freed ones are poisoned)."""
        for b in req.blocks[keep:]:
            if self.blocks.drop(b):
                self._poison(self.cache, b)
        del req.blocks[keep:]

    def _ensure_blocks(self, req: _Request, upto: int) -> bool:
        """Blocks for positions ``req.computed .. upto-1``: new ones as needed, and a private
        copy (``copy_blocks``) of a shared block the step writes into. False when the pool is
        empty."""
        bs = self.bs
        first, last = req.computed // bs, (upto - 1) // bs
        need = last + 1 - len(req.blocks)
        shared = [
            i
            for i in range(first, min(last + 1, len(req.blocks)))
            if self.blocks.refs[req.blocks[i]] > 1
        ]
        if len(self.blocks.free) < max(need, 0) + len(shared):
            return False
        cow = []
        for i in shared:
            new = self.blocks.take()
            cow.append([req.blocks[i], new])
            self.blocks.drop(req.blocks[i])
            req.blocks[i] = new
        if cow:  # copied now: a later preemption may free and poison the source
            self.cache.copy_blocks(cow)
            self.report.copy_on_write += len(cow)
        for _ in range(max(need, 0)):
            req.blocks.append(self.blocks.take())
        return True

    # --- one step ---
    def _schedule(self) -> list[tuple[_Request, int, int]]:  # (request, query_len, drafts)
        caps, bs = self.caps, self.bs
        candidates = [r for r in self.running if not r.swapped]
        if caps.cascade and len(candidates) > 1 and self.rng.random() < 0.3:
            families: dict[int, list[_Request]] = {}
            for r in candidates:
                families.setdefault(r.family, []).append(r)
            biggest = max(families.values(), key=len)
            if len(biggest) > 1:
                candidates = biggest  # a step of one family: their prefix is common
        self.rng.shuffle(candidates)
        plan: list[tuple[_Request, int, int]] = []
        budget = self.token_budget
        for req in candidates:
            if budget <= 0:
                break
            if req not in self.running or req.swapped:
                continue  # preempted for an earlier one of this step
            drafts = 0
            if req.computed < req.prompt_len:
                left = req.prompt_len - req.computed
                q = (
                    left
                    if not caps.chunked_prefill
                    else min(left, budget, self.rng.randint(1, 2 * bs + 3))
                )
                if not caps.chunked_prefill and (req.computed or q > budget):
                    continue
            else:
                q = 1
                if caps.multi_token_decode and self.rng.random() < 0.3:
                    drafts = self.rng.randint(1, 3)
                    q += drafts
            while not self._ensure_blocks(req, req.computed + q):
                others = [r for r in self.running if r is not req and r not in [p[0] for p in plan]]
                if not others:
                    break
                self._preempt(others[-1])
            else:
                plan.append((req, q, drafts))
                budget -= q
                continue
            # the pool is empty even with every other request preempted: this one waits too
            self._preempt(req)
        threshold = self.builder.reorder_batch_threshold
        if threshold is not None:  # decodes first, as the builder asks
            plan.sort(key=lambda p: p[1] > threshold)
        return plan

    def step(self) -> None:
        self.step_no += 1
        self._admit()
        plan = self._schedule()
        if not plan:
            return
        spec, bs, dev = self.spec, self.bs, self.dev
        for req, q, _ in plan:  # decode tokens and drafts: new positions, new keys
            grow = req.computed + q - req.known
            if grow > 0:
                k, v = self._kv(grow)
                req.key, req.value = torch.cat([req.key, k]), torch.cat([req.value, v])
        query_lens = [q for _, q, _ in plan]
        seq_lens = [req.computed + q for req, q, _ in plan]
        width = max(len(req.blocks) for req, _, _ in plan) + self.rng.randint(0, 1)
        table = torch.zeros(len(plan), width, dtype=torch.int32)
        for i, (req, _, _) in enumerate(plan):
            table[i, : len(req.blocks)] = torch.tensor(req.blocks, dtype=torch.int32)
        n = sum(query_lens)
        pad = self.rng.choice([0, 0, 0, 1, self.rng.randint(2, 9)])
        batch = BatchMetadata.from_lengths(query_lens, seq_lens, table, bs, dev, num_tokens=n + pad)
        common = 0
        if self.caps.cascade:
            common = self._common_prefix(plan)
        shape = (n + pad, spec.num_heads, spec.head_size)
        query = torch.randn(shape, generator=self.gen).to(spec.dtype)
        rows_k = [req.key[req.computed : req.computed + q] for req, q, _ in plan]
        rows_v = [req.value[req.computed : req.computed + q] for req, q, _ in plan]
        garbage = torch.randn(pad, spec.num_kv_heads, spec.head_size, generator=self.gen) * 100
        key = torch.cat([*rows_k, garbage.double()]).to(spec.dtype)
        value = torch.cat([*rows_v, garbage.double()]).to(spec.dtype)
        try:
            meta = self.builder.build(batch, common_prefix_len=common)
            out = self.impl.forward(query.to(dev), key.to(dev), value.to(dev), self.cache, meta)
        except AttnhubError as exc:
            self.report.typed_errors += 1
            self._fail(f"a valid step was refused: {type(exc).__name__}: {exc}")
            raise _Stop from exc
        except Exception as exc:
            self.report.untyped_errors += 1
            self._fail(f"a valid step raised {type(exc).__name__}: {exc}")
            raise _Stop from exc
        self._check_output(plan, batch, query, out, n)
        r = self.report
        r.steps += 1
        r.tokens += n
        r.kv_writes += n
        r.padding_rows += pad
        r.cascade_steps += bool(common)
        for req, q, drafts in plan:
            if req.computed and q > 1 and not drafts:
                r.chunked_prefills += 1
            req.computed += q
            if drafts:
                r.multi_token_decodes += 1
                rejected = self.rng.randint(0, drafts)
                if rejected:  # the rejected drafts' positions are free again
                    r.rejected_drafts += rejected
                    req.computed -= rejected
                    req.key, req.value = req.key[: req.computed], req.value[: req.computed]
                    self._release(req, keep=math.ceil(req.computed / bs))
            if req.computed >= req.max_len and req.computed >= req.prompt_len:
                self.running.remove(req)
                self._release(req)
                r.requests_finished += 1

    def _common_prefix(self, plan: list[tuple[_Request, int, int]]) -> int:
        """Tokens of the leading blocks every request of the step shares, whole blocks within
        every request's cached context (as vLLM computes common_prefix_len)."""
        if len(plan) < 2:
            return 0
        first = plan[0][0].blocks
        blocks = 0
        while all(
            len(req.blocks) > blocks and req.blocks[blocks] == first[blocks] for req, _, _ in plan
        ):
            blocks += 1
        shortest = min(req.computed for req, _, _ in plan)
        return min(blocks, shortest // self.bs) * self.bs

    def _check_output(
        self,
        plan: list[tuple[_Request, int, int]],
        batch: BatchMetadata,
        query: torch.Tensor,
        out: torch.Tensor,
        n: int,
    ) -> None:
        spec = self.spec
        expected, start = [], 0
        for req, q, _ in plan:
            seq = req.computed + q
            want, _ = attention(
                query[start : start + q],
                req.key[:seq],
                req.value[:seq],
                scale=spec.scale,
                causal=spec.causal,
                window=spec.window,
                logits_soft_cap=spec.logits_soft_cap,
                alibi_slopes=None if self.slopes is None else self.slopes.cpu(),
                sinks=None if self.sinks is None else self.sinks.cpu(),
            )
            expected.append(want)
            start += q
        got = out.detach().to("cpu")
        why = testing.mismatch(got[:n], torch.cat(expected), self.tol, batch)
        if why is None and not bool((got[n:] == 0).all()):
            why = f"padding rows {n}..{got.shape[0] - 1} are not zero"
        if why is not None:
            self.report.divergences += 1
            rids = [req.rid for req, _, _ in plan]
            self._fail(f"output differs from the shadow model (requests {rids}): {why}")

    def check_cache(self) -> None:
        """Every live request's cached positions hold exactly the shadow's keys and values
        (in the device cache, or in the swap space while swapped out)."""
        plain = {id(c): c.unpacked() for c in (self.cache, self.swap)}  # packed: logical K/V
        for req in [*self.running, *self.waiting]:
            if not req.computed:
                continue
            cache = plain[id(self.swap if req.swapped else self.cache)]
            pos = torch.arange(req.computed)
            blocks = torch.tensor(req.blocks, dtype=torch.long)[pos // self.bs]
            offsets = pos % self.bs
            k = cache.key_nhd()[blocks, offsets].to("cpu", torch.float64)
            v = cache.value_nhd()[blocks, offsets].to("cpu", torch.float64)
            self.report.cache_checks += 1
            for which, got, want in (("key", k, req.key), ("value", v, req.value)):
                bad = (got != want[: req.computed]).flatten(1).any(1).nonzero()
                if bad.numel():
                    p = int(bad[0, 0])
                    self.report.corruptions += 1
                    where = "swap space" if req.swapped else "cache"
                    self._fail(
                        f"request {req.rid}: the {where} holds another {which} than was written "
                        f"at position {p} (block {req.blocks[p // self.bs]}, offset "
                        f"{p % self.bs}) and {bad.numel() - 1} more positions"
                    )
                    break

    def drain(self) -> None:
        """Finish every request (memory is compared between two drained moments)."""
        for req in [*self.running, *self.waiting]:
            if req.swapped:
                for h in req.blocks:
                    self.swap_free.append(h)
                req.blocks = []
            else:
                self._release(req)
        self.running, self.waiting = [], []


#: The most tokens a request generates (prompts are up to 3 blocks + 5 tokens long).
GENERATED = 40


class _Stop(Exception):
    """A valid step raised: the engine's state is no longer known; the soak ends there."""


def _rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, AttributeError):  # not Linux: resident size unknown
        import resource

        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


def _tensor_mib() -> float:
    """Memory of the storages of every tensor the garbage collector can reach."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if issubclass(type(obj), torch.Tensor):  # isinstance: deprecation warnings
                s = obj.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
        except Exception:  # a tensor without storage (meta, sparse): nothing resident
            continue
    return sum(seen.values()) / 2**20


def run(
    backend: AttentionBackend,
    steps: int,
    seed: int = 0,
    *,
    num_blocks: int | None = None,
    max_running: int = 8,
    check_every: int = 10,
    warmup: int | None = None,
) -> SoakReport:
    """Soak ``backend`` (an instance bound to an unquantized spec and a device) for ``steps``
    engine steps drawn from ``seed``. ``num_blocks`` (default: room for about four requests'
    longest sequences, so that preemption happens) sizes the cache; ``check_every`` steps the
    whole cache is compared with the shadow; memory is measured after ``warmup`` steps
    (default a tenth, at most 200) and at the end, each time with every request finished."""
    spec = backend.spec
    if spec.kv_cache_format.is_quantized or not spec.causal:
        raise attnhub.errors.InvalidInputError(
            f"the soak runs decoder layers over unquantized caches; got {spec}"
        )
    bs = spec.block_size
    longest = math.ceil((3 * bs + 5 + GENERATED) / bs) + 2  # a prompt, its tokens, 2 forks' worth
    # what ``max_running`` requests of mean length hold (a partly filled block each), less 15%:
    # running requests outgrow the pool now and then, and one of them is preempted
    mean_tokens = (1 + bs / 2 + 2 * bs + 2.5) / 3 + GENERATED / 2
    demand = max_running * (mean_tokens / bs + 1)
    num_blocks = num_blocks or max(longest + 2, int(0.85 * demand))
    report = SoakReport(backend_label(backend), _describe(spec), seed)
    engine = _Engine(
        backend,
        report,
        seed=seed,
        num_blocks=num_blocks,
        swap_blocks=2 * longest,
        max_running=max_running,
        token_budget=4 * bs + 8,
    )
    warmup = min(steps // 10, 200) if warmup is None else warmup
    started = time.perf_counter()
    rss0 = tensors0 = None
    try:
        for i in range(steps):
            if i == warmup:
                engine.drain()
                rss0, tensors0 = _rss_mib(), _tensor_mib()
            engine.step()
            if engine.step_no % check_every == 0:
                engine.check_cache()
        engine.check_cache()
    except _Stop:
        pass
    engine.drain()
    if rss0 is not None and tensors0 is not None:
        report.rss_growth_mib = _rss_mib() - rss0
        report.tensor_growth_mib = _tensor_mib() - tensors0
    report.seconds = time.perf_counter() - started
    return report


def backend_label(backend: AttentionBackend) -> str:
    """``backend.name``, and its provider where the class names one (``flash-fa3``)."""
    provider = getattr(type(backend), "provider", None)
    return f"{backend.name}-{provider}" if isinstance(provider, str) else backend.name


def _describe(spec: AttentionSpec) -> str:
    dtype = str(spec.dtype).removeprefix("torch.")
    return (
        f"{dtype} h{spec.head_size} {spec.num_heads}/{spec.num_kv_heads} heads bs{spec.block_size}"
    )


# --- the command -------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attnhub_conformance.soak",
        description="Soak attnhub backends with random engine steps against a shadow model, "
        "and fuzz their API boundary; print the figures. Exit status 1 if anything was wrong.",
    )
    parser.add_argument("--backend", action="append", default=[], help="backend name (repeatable)")
    parser.add_argument("--steps", type=int, default=1000, help="soak steps per backend")
    parser.add_argument("--fuzz-examples", type=int, default=0, help="fuzz examples per backend")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", type=torch_device)
    parser.add_argument("--emulate", action="store_true", help="vendor backends through emulators")
    parser.add_argument("--label", default=None, help="the backend's name in the figures")
    parser.add_argument("--json", default=None, help="append the reports to this JSON-lines file")
    parser.add_argument(
        "--table", default=None, metavar="JSONL", help="print the fault table of a JSON-lines file"
    )
    args = parser.parse_args(argv)
    if args.table:
        print(fault_table(args.table))
        return 0
    names = args.backend or [i.name for i in attnhub.list_backends() if i.backend is not None]
    classes = {}
    for name in names:  # every name checked before the first backend's minutes of soak
        try:
            classes[name] = attnhub.get_backend(name)
        except NoBackendError as exc:
            parser.error(f"--backend: {exc.message}")
    failed = False
    for name, cls in classes.items():
        why = cls.availability(args.device, args.emulate)
        if why is not None:
            print(f"soak {name}: cannot run on {args.device}: {why}", file=sys.stderr)
            failed = True
            continue
        backend = cls(default_spec(cls), args.device, emulate=args.emulate)
        reports: list[Any] = []
        if args.steps:
            reports.append(run(backend, args.steps, args.seed))
        if args.fuzz_examples:
            from attnhub_conformance import fuzz  # hypothesis: only where the fuzz runs

            reports.append(fuzz.run(backend, args.fuzz_examples, args.seed))
        for report in reports:
            if args.label:
                report.backend = args.label
            print(report.summary(), flush=True)
            if not report.ok:
                print(report.failures(), flush=True)
                failed = True
            if args.json:
                with open(args.json, "a") as f:
                    kind = "soak" if isinstance(report, SoakReport) else "fuzz"
                    f.write(json.dumps({"kind": kind, **asdict(report)}) + "\n")
    return 1 if failed else 0


def fault_table(path: str) -> str:
    """Markdown tables of the soak and fuzz reports in a JSON-lines file (``--json``)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    soaks = [r for r in rows if r["kind"] == "soak"]
    fuzzes = [r for r in rows if r["kind"] == "fuzz"]
    out = [
        "| backend | spec | steps | tokens | requests | preemptions (recompute / swap) | "
        "copy-on-write | cascade steps | drafts rejected | divergences | corruptions | "
        "typed / untyped errors | memory growth after warm-up (RSS / tensors) | seconds |",
        "|" + "---|" * 14,
    ]
    for r in soaks:
        out.append(
            f"| {r['backend']} | {r['spec']} | {r['steps']} | {r['tokens']} | "
            f"{r['requests_finished']} | {r['preempted_recompute']} / {r['preempted_swap']} | "
            f"{r['copy_on_write']} | {r['cascade_steps']} | {r['rejected_drafts']} | "
            f"{r['divergences']} | {r['corruptions']} | {r['typed_errors']} / "
            f"{r['untyped_errors']} | {r['rss_growth_mib']:+.1f} MiB / "
            f"{r['tensor_growth_mib']:+.2f} MiB | {r['seconds']:.0f} |"
        )
    if fuzzes:
        targets = list(fuzzes[0]["examples"])
        out += [
            "",
            "| backend | examples | " + " | ".join(targets) + " | accepted | typed errors | "
            "untyped errors | cache corruptions | wrong results | known defects tripped |",
            "|" + "---|" * (len(targets) + 8),
        ]
        for r in fuzzes:
            known = ", ".join(sorted({v.split(":")[0] for v in r["known_seen"].values()}))
            out.append(
                f"| {r['backend']} | {sum(r['examples'].values())} | "
                + " | ".join(str(r["examples"][t]) for t in targets)
                + f" | {r['accepted']} | {r['typed_errors']} | {r['untyped_errors']} | "
                f"{r['corruptions']} | {r['wrong_results']} | {r['known']}"
                + (f" ({known})" if known else "")
                + " |"
            )
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
