"""Decode context parallel steps captured in graphs (``DcpGraphRunner``), on 2 gloo ranks
spawned here (``attnhub_conformance.multi_rank``'s harness: bounded, reaped on failure).

Each rank runs the torch backend (the eager tape standing in for the device graph) and the
ascend backend (emulated ops, its emulated ``torch.npu`` graph API with task-group updates): a
two-layer model captured at two sizes and replayed with new steps (new per-rank lengths, new
requests, a request whose shard is empty on rank 1), each compared with the eager DCP run of
the same step (a twin with its own caches), the float64 single-rank reference, and the twin's
caches byte for byte. Then: no host synchronize per replay (the emulator's counter), a replay
whose update is skipped (ascend: the emulator raises; torch: lengths left stale give a
mismatch), and a batch larger than every capture size refused with a typed error on every rank
(caches untouched, the group still in step).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from attnhub_conformance.hostsync import guard, guard_cache, guard_tree, unguard
from attnhub_conformance.multi_rank import load_backend, run_group

from attnhub import AttentionSpec, BatchMetadata, testing
from attnhub.context_parallel import (
    AllGatherReduceScatter,
    AllToAll,
    DcpGraphRunner,
    DecodeContextParallel,
    collective_refusal,
    local_slot_mapping,
)
from attnhub.graphs import BatchTooLargeError

N = 2
SPECS = {
    "torch": AttentionSpec(
        num_heads=2, num_kv_heads=1, head_size=16, dtype=torch.float32, block_size=4,
        use_sinks=True,
    ),
    "ascend": AttentionSpec(
        num_heads=2, num_kv_heads=1, head_size=64, dtype=torch.float16, block_size=128
    ),
}  # fmt: skip
#: (interleave, communication variant) per backend: both variants and both interleaves run.
LAYOUT = {"torch": (1, AllGatherReduceScatter), "ascend": (128, AllToAll)}
WIDTH = 2  # virtual blocks per request in the runner's table
MAX_REQS = 5  # table rows; the largest capture size is 4
CAPTURE_SIZES = [2, 4]
#: Requests per step: capture sizes 4, 2, 4, 4, 4, 2, 4 (several replays of each, new lengths
#: each time); step MULTI holds a decode of 3 tokens (3 + 1 rows: size 4).
STEPS = (3, 1, 4, 2, 3, 2, 4)
MULTI = 3


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _reference(
    q: torch.Tensor,  # [H, D]
    k: torch.Tensor,  # [s, K, D]
    v: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:  # [H, D] float64: one decode row over every key of its sequence
    heads, kv = q.shape[0], k.shape[1]
    kk = k.double().repeat_interleave(heads // kv, dim=1)
    vv = v.double().repeat_interleave(heads // kv, dim=1)
    scores = torch.einsum("hd,shd->hs", q.double(), kk) * scale
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
    p = torch.softmax(scores, dim=1)[:, : k.shape[0]]
    return torch.einsum("hs,shd->hd", p, vv)


class Model:
    """Two layers on one rank: the captured model and its eager twin (own caches each)."""

    def __init__(self, name: str, rank: int) -> None:
        self.spec = spec = SPECS[name]
        self.rank = rank
        cls = load_backend(name)
        self.backend = cls(spec, "cpu", emulate=name != "torch")
        interleave, variant = LAYOUT[name]
        self.interleave = interleave
        self.dcp = DecodeContextParallel(
            self.backend, variant(), world_size=N, interleave=interleave
        )
        b, hl, kv, d = spec.block_size, spec.num_heads, spec.num_kv_heads, spec.head_size
        self.virtual = N * b
        self.maxlen = WIDTH * self.virtual
        g = testing.generator(11)
        self.num_blocks = 1 + MAX_REQS * WIDTH + 1
        self.table = testing.shuffled_block_table(
            [self.maxlen] * MAX_REQS, self.virtual, self.num_blocks, g
        )
        self.heads = slice(rank * hl, (rank + 1) * hl)
        self.all_sinks = torch.randn(N * hl, generator=g) + 1.0 if spec.use_sinks else None
        self.seeded_nan = not cls.capabilities.finite_stale_slots
        self.layers: list[dict[str, Any]] = []
        for _ in range(2):
            keys = torch.randn(MAX_REQS, self.maxlen, kv, d, generator=g).to(spec.dtype)
            values = torch.randn(MAX_REQS, self.maxlen, kv, d, generator=g).to(spec.dtype)
            sinks = None if self.all_sinks is None else self.all_sinks[self.heads]
            impl = self.backend.impl(sinks=sinks)
            layer = dict(impl=impl, keys=keys, values=values)
            for which in ("graph", "twin"):
                cache = self.backend.allocate_kv_cache(self.num_blocks)
                with cache.edit() as plain:
                    fill = math.nan if self.seeded_nan else 0.0
                    plain.key.fill_(fill)
                    plain.value.fill_(fill)
                for r in range(MAX_REQS):  # every request's history: earlier steps' keys
                    pos = torch.arange(self.maxlen)
                    slots = local_slot_mapping(pos, torch.full_like(pos, r), self.table, b, N,
                                               rank, interleave)  # fmt: skip
                    impl.write_kv(keys[r], values[r], cache, torch.from_numpy(slots))
                layer[which] = cache
            self.layers.append(layer)
        self.runner = DcpGraphRunner(
            self.dcp,
            self.graph_step,
            capture_sizes=CAPTURE_SIZES,
            max_blocks_per_req=WIDTH,
            kv_caches=[layer["graph"] for layer in self.layers],
        )

    def graph_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Any) -> Any:
        """Every layer with its device-side inputs under the host-sync guard (the step runs
        inside the capture): a host read of device data raises."""
        step = guard_tree(step, "the DCP step")
        q, k, v = (guard(x, what) for x, what in ((q, "query"), (k, "key"), (v, "value")))
        return tuple(
            unguard(self.dcp.forward(layer["impl"], step, q, k, v, guard_cache(layer["graph"])))
            for layer in self.layers
        )

    def batch(
        self,
        seed: int,
        num_reqs: int,
        *,
        runs: bool = True,
        multi: bool = False,
        causal: bool = True,
    ) -> tuple[Any, ...]:
        """A step of ``num_reqs`` decodes (the same on every rank; with ``multi`` the first is
        a decode of 3 tokens): its batch, the query of every head, the new keys and values
        (written into the histories where the step ``runs``), and each row's (request,
        position)."""
        g = testing.generator(seed)
        spec = self.spec
        reqs = torch.randperm(MAX_REQS, generator=g)[:num_reqs].tolist()
        qlens = [3 if multi and i == 0 else 1 for i in range(num_reqs)]
        seqs = torch.randint(3, self.maxlen + 1, (num_reqs,), generator=g).tolist()
        if num_reqs >= 2:
            seqs[1] = 1  # rank 1 holds none of it: its shard of the request is empty
        rows = [(r, s - ql + t) for r, s, ql in zip(reqs, seqs, qlens, strict=True)
                for t in range(ql)]  # fmt: skip
        shape = (len(rows), spec.num_kv_heads, spec.head_size)
        k = torch.randn(*shape, generator=g).to(spec.dtype)
        v = torch.randn(*shape, generator=g).to(spec.dtype)
        q = torch.randn(len(rows), N * spec.num_heads, spec.head_size, generator=g)
        for layer in self.layers if runs else ():
            for i, (r, p) in enumerate(rows):
                layer["keys"][r, p] = k[i]
                layer["values"][r, p] = v[i]
        batch = BatchMetadata.from_lengths(
            qlens, seqs, self.table[reqs], self.virtual, causal=causal
        )
        return batch, q.to(spec.dtype), k, v, rows

    def check(self, batch: BatchMetadata, q: torch.Tensor, k: Any, v: Any, rows: Any) -> list:
        """One step through the graph and the twin; what differs."""
        errors = []
        local_q = q[:, self.heads].contiguous()
        graph_outs = [o.clone() for o in self.runner.run(batch, local_q, k, v)]
        step = self.dcp.plan(batch)
        tol = self.backend.capabilities.tolerances[self.spec.dtype]
        for i, layer in enumerate(self.layers):
            eager = self.dcp.forward(layer["impl"], step, local_q, k, v, layer["twin"])
            ref = torch.stack([
                _reference(q[j], layer["keys"][r, : p + 1], layer["values"][r, : p + 1],
                           self.spec.scale, self.all_sinks)[self.heads]
                for j, (r, p) in enumerate(rows)
            ])  # fmt: skip
            for what, want in (
                ("the eager DCP run", torch.as_tensor(eager).double()),
                ("the reference", ref),
            ):
                why = testing.mismatch(graph_outs[i], want, tol)
                if why is not None:
                    errors.append(f"layer {i}: the graph vs {what}: {why}")
            for plane in ("key", "value"):
                a, b = getattr(layer["graph"], plane), getattr(layer["twin"], plane)
                if not torch.equal(_bits(a), _bits(b)):
                    errors.append(f"layer {i}: the graph's {plane} cache is not the twin's")
        return errors


def _keep_buffers(runner: DcpGraphRunner) -> None:
    """From the next step on, the runner's batch buffers (per-rank lengths, slots, tables)
    keep that step's values: a replay whose refresh is skipped."""
    buffers = runner.batch_buffers
    load, kept = buffers.load, list[BatchMetadata]()

    def stale(padded: Any, causal: bool = True) -> Any:
        if not kept:
            kept.append(load(padded, causal=causal))
        return kept[0]

    buffers.load = stale  # type: ignore[method-assign,assignment]


def _outcome(call: Any) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


def _capture_refusals(model: Model, rank: int, alive: Any) -> dict[str, Any]:
    """On fresh runners (nothing captured yet): a capture-time build that fails on rank 0
    only, then the same step again with the build restored; ranks configured with other
    capture sizes. After each, whether the group is still in step."""
    found: dict[str, Any] = {}
    caches = [layer["graph"] for layer in model.layers]
    runner = DcpGraphRunner(model.dcp, model.graph_step, capture_sizes=[8],
                            max_blocks_per_req=WIDTH, kv_caches=caches)  # fmt: skip
    builder = runner.builder
    assert builder is not None
    build = builder.build_for_graph_capture

    def fails_on_rank_0(step_batch: Any) -> Any:
        if rank == 0:
            raise RuntimeError("this test's capture-time build fails on rank 0")
        return build(step_batch)

    builder.build_for_graph_capture = fails_on_rank_0  # type: ignore[method-assign]
    before = [_bits(c.key).clone() for c in caches]
    batch, q, k, v, rows = model.batch(500, 3)
    local_q = q[:, model.heads].contiguous()
    found["build_fails"] = _outcome(lambda: runner.run(batch, local_q, k, v))
    found["build_fails_alive"] = alive()
    found["build_fails_untouched"] = all(
        torch.equal(b, _bits(c.key)) for b, c in zip(before, caches, strict=True)
    )
    found["build_fails_graphs"] = len(runner.graphs)
    del builder.build_for_graph_capture  # restored: the same step captures on every rank
    model.runner, kept = runner, model.runner
    found["after_build_fails"] = model.check(batch, q, k, v, rows)
    found["after_build_fails_stats"] = dict(runner.stats)
    model.runner = kept
    found["after_build_fails_alive"] = alive()

    other = DcpGraphRunner(model.dcp, model.graph_step,
                           capture_sizes=[2, 4] if rank == 0 else [4, 8],
                           max_blocks_per_req=WIDTH, kv_caches=caches)  # fmt: skip
    batch, q, k, v, _ = model.batch(600, 3, runs=False)
    before = [_bits(c.key).clone() for c in caches]
    found["sizes_differ"] = _outcome(lambda: other.run(batch, q[:, model.heads].contiguous(), k, v))
    found["sizes_differ_alive"] = alive()
    found["sizes_differ_untouched"] = all(
        torch.equal(b, _bits(c.key)) for b, c in zip(before, caches, strict=True)
    )
    return found


def graph_rank(rank: int, n: int, job: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    def alive() -> int:
        one = torch.ones(1)
        dist.all_reduce(one)
        return int(one.item())

    found: dict[str, Any] = {}
    for name in job["backends"]:
        model = Model(name, rank)
        report: dict[str, Any] = {"errors": [], "syncs": [], "local_lens": []}
        syncs = None
        if name == "ascend":
            from attnhub_ascend import npu_graph

            syncs = npu_graph.host_syncs
        for i, num_reqs in enumerate(STEPS):
            before = sum(syncs.values()) if syncs is not None else 0
            captures = model.runner.stats["captures"]
            report["errors"] += [
                f"step {i}: {e}" for e in model.check(*model.batch(i, num_reqs, multi=i == MULTI))
            ]
            if syncs is not None and model.runner.stats["captures"] == captures:
                report["syncs"].append(sum(syncs.values()) - before)
            report["local_lens"].append(model.runner.last_shard.seq_lens.tolist())
        report["stats"] = dict(model.runner.stats)

        # a batch larger than every capture size: typed, on every rank, caches untouched
        caches = [_bits(layer["graph"].key).clone() for layer in model.layers]
        batch, q, k, v, _ = model.batch(100, MAX_REQS, runs=False)
        try:
            model.runner.run(batch, q[:, model.heads].contiguous(), k, v)
            report["too_large"] = ("no error", "")
        except Exception as exc:
            report["too_large"] = (type(exc).__name__, str(exc))
        report["too_large_untouched"] = all(
            torch.equal(before, _bits(layer["graph"].key))
            for before, layer in zip(caches, model.layers, strict=True)
        )
        report["too_large_alive"] = alive()

        # a size first captured with a step that is not causal (one-token decodes: each row
        # sees every key of its request either way): the rank's call is the flat step, causal
        fresh = DcpGraphRunner(model.dcp, model.graph_step, capture_sizes=CAPTURE_SIZES,
                               max_blocks_per_req=WIDTH,
                               kv_caches=[layer["graph"] for layer in model.layers])  # fmt: skip
        model.runner, kept = fresh, model.runner
        try:
            errors = model.check(*model.batch(120, 3, causal=False))
            report["non_causal"] = ("mismatch" if errors else "no error", "; ".join(errors))
        except Exception as exc:
            report["non_causal"] = (type(exc).__name__, str(exc))
        model.runner = kept
        report["non_causal_alive"] = alive()

        # bad inputs on rank 0 only: refused by every rank (rank 0 its own error, the others
        # naming it), before any collective of the graph
        batch, q, k, v, _ = model.batch(150, 3, runs=False)
        local_q = q[:, model.heads].contiguous()
        try:
            model.runner.run(batch, local_q[:, :1] if rank == 0 else local_q, k, v)
            report["one_rank_refuses"] = ("no error", "")
        except Exception as exc:
            report["one_rank_refuses"] = (type(exc).__name__, str(exc))
        report["one_rank_refuses_alive"] = alive()
        if name == "torch":  # before the skipped update below leaves the caches stale
            report.update(_capture_refusals(model, rank, alive))

        # a replay whose update is skipped
        if name == "ascend":
            batch, q, k, v, _ = model.batch(200, 3, runs=False)
            builder = model.runner.builder
            assert builder is not None
            builder.update_graph_params = lambda *a: None  # type: ignore[method-assign]
            try:
                model.runner.run(batch, q[:, model.heads].contiguous(), k, v)
                report["skipped"] = ("no error", "")
            except Exception as exc:
                report["skipped"] = (type(exc).__name__, str(exc))
            del builder.update_graph_params
        else:  # torch has no update: the buffers (lengths, tables) keep an earlier step's
            _keep_buffers(model.runner)
            report["errors"] += model.check(*model.batch(300, 3))  # loaded: its buffers stay
            errors = model.check(*model.batch(200, 3))
            report["skipped"] = ("mismatch" if errors else "no error", "; ".join(errors))
        report["skipped_alive"] = alive()
        found[name] = report
    # whether the (gloo) group may sit in a graph of each device's kind
    group = AllGatherReduceScatter()
    found["collectives"] = {
        device: collective_refusal(
            SimpleNamespace(
                backend=SimpleNamespace(device=SimpleNamespace(type=device)), group=group
            )
        )
        for device in ("cpu", "cuda", "npu")
    }
    return found


@pytest.fixture(scope="module")
def reports() -> dict[int, Any]:
    job = dict(
        backend="torch", spec=None, device="cpu", emulate=False, sub_cases=[],
        backends=list(SPECS), extra=f"{__name__}:graph_rank",
    )  # fmt: skip
    return {rank: report["extra"] for rank, report in run_group(N, job).items()}


@pytest.mark.parametrize("name", list(SPECS))
def test_replays_with_new_per_rank_lengths_equal_eager_dcp_and_the_reference(
    reports: dict[int, Any], name: str
) -> None:
    for rank in range(N):
        report = reports[rank][name]
        assert report["errors"] == [], (rank, report["errors"])
        assert report["stats"] == {"captures": 2, "replays": len(STEPS)}
    lens = [reports[r][name]["local_lens"] for r in range(N)]
    # new per-rank lengths at every replay, and a request whose shard on rank 1 is empty
    assert len({tuple(x) for x in lens[1]}) == len(STEPS)
    assert any(0 in x for x in lens[1])


def test_no_host_synchronize_per_replay(reports: dict[int, Any]) -> None:
    for rank in range(N):
        syncs = reports[rank]["ascend"]["syncs"]
        assert syncs and syncs == [0] * len(syncs)  # a capture syncs once (torch_npu's own)


@pytest.mark.parametrize(("name", "kind"), [("ascend", "NpuGraphError"), ("torch", "mismatch")])
def test_a_skipped_update_is_detected(reports: dict[int, Any], name: str, kind: str) -> None:
    for rank in range(N):
        report = reports[rank][name]
        assert report["skipped"][0] == kind, report["skipped"]
        assert report["skipped_alive"] == N


@pytest.mark.parametrize("name", list(SPECS))
def test_a_step_that_is_not_causal_is_captured_as_the_eager_flat_step(
    reports: dict[int, Any], name: str
) -> None:
    """The rank's call is its flat step (one-token rows, causal, their lengths the rows'
    keys): a step with ``causal=False`` is captured as such (ascend's builder refuses to
    capture a non-causal batch) and replays like the eager DCP run and the reference."""
    for rank in range(N):
        report = reports[rank][name]
        assert report["non_causal"] == ("no error", ""), report["non_causal"]
        assert report["non_causal_alive"] == N


@pytest.mark.parametrize("name", list(SPECS))
def test_a_batch_larger_than_captured_is_a_typed_error_on_every_rank(
    reports: dict[int, Any], name: str
) -> None:
    for rank in range(N):
        report = reports[rank][name]
        kind, message = report["too_large"]
        assert kind == BatchTooLargeError.__name__, message
        assert f"a batch of {MAX_REQS} tokens" in message
        assert report["too_large_untouched"] and report["too_large_alive"] == N


def test_inputs_refused_on_one_rank_stop_every_rank(reports: dict[int, Any]) -> None:
    for name in SPECS:
        kinds = [reports[r][name]["one_rank_refuses"] for r in range(N)]
        assert kinds[0][0] == "InvalidInputError" and "input 0" in kinds[0][1], kinds[0]
        assert all(k == "InvalidInputError" and "rank(s) [0]" in m for k, m in kinds[1:])
        assert all(reports[r][name]["one_rank_refuses_alive"] == N for r in range(N))


def test_gloo_collectives_are_refused_in_a_device_graph(reports: dict[int, Any]) -> None:
    """On the host the tape reruns gloo's collectives; a CUDA graph needs NCCL's, an NPU graph
    HCCL's."""
    for rank in range(N):
        found = reports[rank]["collectives"]
        assert found["cpu"] is None
        assert "gloo collectives cannot be captured on cuda (nccl's can)" in found["cuda"]
        assert "gloo collectives cannot be captured on npu (hccl's can)" in found["npu"]


def test_a_capture_time_build_failing_on_one_rank_is_raised_on_every_rank(
    reports: dict[int, Any],
) -> None:
    """The first step of a size builds the gathered backend's capture metadata over the
    rank's own lengths: a failure on rank 0 only is settled over the group, every rank raises
    before the capture's collectives (no graph kept, caches untouched), and the same step
    captures and replays on every rank afterwards."""
    found = [reports[r]["torch"] for r in range(N)]
    kind, message = found[0]["build_fails"]
    assert kind == "InvalidInputError" and "capture-time build failed on this rank" in message
    assert "this test's capture-time build fails on rank 0" in message
    for other in found[1:]:
        kind, message = other["build_fails"]
        assert kind == "InvalidInputError", message
        assert "capture-time build failed on rank(s) [0]" in message
        assert "this test's capture-time build fails on rank 0" in message
    for report in found:
        assert report["build_fails_alive"] == N and report["build_fails_untouched"]
        assert report["build_fails_graphs"] == 0
        assert report["after_build_fails"] == []
        assert report["after_build_fails_stats"] == {"captures": 1, "replays": 1}
        assert report["after_build_fails_alive"] == N


def test_ranks_configured_with_other_capture_sizes_all_refuse_the_step(
    reports: dict[int, Any],
) -> None:
    """They would pad the step to other row counts and meet in collectives of other shapes:
    the step's agreement carries the capture sizes."""
    for rank in range(N):
        report = reports[rank]["torch"]
        kind, message = report["sizes_differ"]
        assert kind == "InvalidInputError", message
        assert "capture_sizes differs between ranks" in message
        assert report["sizes_differ_alive"] == N and report["sizes_differ_untouched"]
