"""What one rank runs in ``test_vllm_dcp.py``: the adapter's decode-context-parallel path with
vLLM's own DCP group and helpers, as vLLM's model runner and layers drive it.

Run by ``attnhub_conformance.multi_rank.run_group`` (spawned gloo ranks, the whole group under a
deadline, every process reaped on failure) as the job's ``extra``: ``run(rank, n, job)``.

On each rank: vLLM's distributed state (``init_worker_distributed_environment``, as vLLM's CPU
worker calls it: world, TP and DCP groups on gloo) for ``tensor_parallel_size = N``,
``decode_context_parallel_size = N``; a vLLM ``Attention`` layer with the adapter's backend
class (this rank's ``Hl`` query heads, the one KV head, replicated); then two steps (first
prefill chunks, then decodes, a multi-token decode and a chunked prefill) as the model runner
hands them over: ``CommonAttentionMetadata`` with the global ``seq_lens``, the table of virtual
blocks, vLLM's DCP-local slot mapping (its own slot-mapping Triton kernel, run by Triton's
interpreter: the CPU build's fallback refuses DCP) and ``dcp_local_seq_lens`` from vLLM's
``get_dcp_local_seq_lens``; ``builder.build``, then per layer ``do_kv_cache_update`` and
``forward``. Each step's output for the rank's heads is compared with the same adapter's
single-rank run (``decode_context_parallel_size = 1``, one cache of ``N x B`` blocks holding
every token), with the float64 reference, and with the rank's partial merged by vLLM's own
``cp_lse_ag_out_rs`` (its correction kernel interpreted, its ``GroupCoordinator``'s
all-gather and reduce-scatter on gloo).
"""

from __future__ import annotations

import os
from typing import Any

HEADS, KV_HEADS, HEAD = 8, 1, 64  # the MQA tiny Llama's attention (vLLM: TP must exceed KV heads)
#: (query_lens, seq_lens) of the two steps: first chunks (request 1 holds one token: with
#: interleave 1 only rank 0 holds it), then a decode, a multi-token decode (3 rows), a chunked
#: prefill over its context and a decode
STEPS = [([5, 1, 9, 3], [5, 1, 9, 3]), ([1, 3, 6, 1], [6, 4, 15, 4])]


def _interpreted(cls: Any) -> Any:
    """``cls.kernel`` (a vLLM Triton kernel's source) run by Triton's interpreter."""
    from vllm_generate import interpreted_kernel

    return interpreted_kernel(cls.__dict__["kernel"].__func__)


def _config(job: dict[str, Any], dcp: int, interleave: int, comm: str) -> Any:
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig

    block = job["block_size"] * (job["world_size"] if dcp == 1 else 1)
    return VllmConfig(
        model_config=ModelConfig(model=job["model"], dtype=job["dtype"], max_model_len=512),
        cache_config=CacheConfig(block_size=block),
        parallel_config=ParallelConfig(
            tensor_parallel_size=job["world_size"],
            decode_context_parallel_size=dcp,
            cp_kv_cache_interleave_size=interleave if dcp > 1 else 1,
            dcp_comm_backend=comm,
        ),
        additional_config={"attnhub": {"backend": job["backend"], "emulate": job["emulate"]}},
    )


class _Engine:
    """One attention layer and its KV cache as vLLM's model runner holds them on this rank."""

    def __init__(self, job: dict[str, Any], config: Any, name: str) -> None:
        import torch
        from attnhub_vllm.backend import AttnhubVllmBackend, AttnhubVllmMetadataBuilder
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.attention import Attention
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        self.config = config
        self.name = name
        n = job["world_size"]
        self.heads = HEADS // n
        dtype = config.model_config.dtype
        block = config.cache_config.block_size
        with set_current_vllm_config(config):
            self.layer = Attention(
                self.heads, HEAD, HEAD**-0.5, num_kv_heads=KV_HEADS,
                cache_config=config.cache_config, prefix=name, attn_backend=AttnhubVllmBackend,
            )  # fmt: skip
            spec = FullAttentionSpec(
                block_size=block, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=dtype
            )
            self.builder = AttnhubVllmMetadataBuilder(spec, [name], config, torch.device("cpu"))
        layout = self.builder._builders[0].backend.capabilities.kv_cache_layout
        blocks = job["num_blocks"]
        if layout == "HND":
            self.cache = torch.zeros((blocks, KV_HEADS, block, 2 * HEAD), dtype=dtype)
        else:  # vLLM's logical [blocks, kv heads, block, 2 * head] over NHD memory
            shape = (blocks, block, KV_HEADS, 2 * HEAD)
            self.cache = torch.zeros(shape, dtype=dtype).permute(0, 2, 1, 3)

    def step(self, cm: Any, q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        """One step of this layer: ``build``, the KV write, the attention. Returns the output
        ``[T, Hl, D]`` and the step's metadata."""
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import set_forward_context

        with set_current_vllm_config(self.config):
            md = self.builder.build(0, cm)
            out = torch.zeros((q.shape[0], self.heads * HEAD), dtype=q.dtype)
            slots = {self.name: cm.slot_mapping}
            with set_forward_context({self.name: md}, self.config, slot_mapping=slots):
                impl = self.layer.impl
                impl.do_kv_cache_update(self.layer, k, v, self.cache, cm.slot_mapping)
                impl.forward(self.layer, q, k, v, self.cache, md, output=out)
        return out.view(-1, self.heads, HEAD), md


def _common(query_lens, seq_lens, table, slots, *, n: int, rank: int, interleave: int) -> Any:  # type: ignore[no-untyped-def]
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    qsl = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    local = get_dcp_local_seq_lens(seq, n, rank, interleave) if n > 1 else None
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq,
        num_reqs=len(query_lens), num_actual_tokens=int(qsl[-1]),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_table_tensor=table,
        slot_mapping=slots, causal=True, dcp_local_seq_lens=local,
        dcp_local_seq_lens_cpu_upper_bound=local,
    )  # fmt: skip


def _vllm_slots(kernel, query_lens, seq_lens, table, *, block, n, rank, interleave):  # type: ignore[no-untyped-def]
    """vLLM's model runner's slot mapping of the step's new tokens (its Triton kernel)."""
    import torch

    qsl = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    positions = torch.cat(
        [torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)]
    )
    tokens = int(qsl[-1])
    slots = torch.full((tokens,), 12345, dtype=torch.int64)
    kernel[(len(query_lens) + 1,)](
        tokens, tokens, qsl, positions, table, table.stride(0), slots,
        KV_CACHE_BLOCK_SIZE=block, TOTAL_CP_WORLD_SIZE=n, TOTAL_CP_RANK=rank,
        CP_KV_CACHE_INTERLEAVE_SIZE=interleave, PAD_ID=-1, BLOCK_SIZE=1024,
    )  # fmt: skip
    return slots


def _vllm_merge(md: Any, engine: _Engine, q: Any) -> Any:
    """The rank's partial (the adapter's gathered backend over the shard, with its LSE) merged
    by vLLM's own ``cp_lse_ag_out_rs`` over vLLM's DCP group, for comparison."""
    import torch
    from vllm.distributed.parallel_state import get_dcp_group
    from vllm.v1.attention.ops.dcp import cp_lse_ag_out_rs

    step = md.metas[0]
    group = get_dcp_group()
    gathered = group.all_gather(q.contiguous(), dim=1)  # vLLM's own query gather
    part, lse = step.gathered_impl.forward(
        gathered, None, None, engine.layer.impl._cache, step.step.meta, return_lse=True
    )
    rows = step.step.meta.batch
    t = rows.num_actual_tokens
    # vLLM's empty-shard mask: each row a sequence of its local length (0: no key here)
    local = torch.where(step.step.empty_rows[:t], 0, rows.seq_lens_cpu[:t]).to(torch.int32)
    out = cp_lse_ag_out_rs(
        part[:t].float().contiguous(), lse[:t].float().contiguous(), group,  # [T, H]
        seq_lens=local, query_start_loc=torch.arange(t + 1, dtype=torch.int32),
    )  # fmt: skip
    return out


def _sub_case(rank: int, n: int, job: dict[str, Any], interleave: int, comm: str) -> dict:
    import torch
    from vllm.v1.worker.block_table import ComputeSlotMappingKernel

    from attnhub import BatchMetadata, reference
    from attnhub.testing import generator, shuffled_block_table

    kernel = _interpreted(ComputeSlotMappingKernel)
    block, tag = job["block_size"], f"I{interleave}-{comm}"
    dcp = _Engine(job, _config(job, n, interleave, comm), f"dcp.{tag}.attn")
    single = _Engine(job, _config(job, 1, 1, comm), f"single.{tag}.attn")
    dtype = dcp.config.model_config.dtype
    final = STEPS[-1][1]
    table = shuffled_block_table(final, n * block, job["num_blocks"], generator(7)).to(torch.int32)
    heads = slice(rank * dcp.heads, (rank + 1) * dcp.heads)  # this TP rank's query heads
    report: dict[str, Any] = {}
    for i, (query_lens, seq_lens) in enumerate(STEPS):
        g = generator(100 + i)
        t = sum(query_lens)
        q_all = torch.randn((t, HEADS, HEAD), generator=g).to(dtype)
        k = torch.randn((t, KV_HEADS, HEAD), generator=g).to(dtype)
        v = torch.randn((t, KV_HEADS, HEAD), generator=g).to(dtype)
        q = q_all[:, heads].contiguous()
        local = dict(n=n, rank=rank, interleave=interleave)
        slots = _vllm_slots(kernel, query_lens, seq_lens, table, block=block, **local)
        cm = _common(query_lens, seq_lens, table, slots, **local)
        got, md = dcp.step(cm, q, k, v)
        one = dict(n=1, rank=0, interleave=1)
        slots1 = _vllm_slots(kernel, query_lens, seq_lens, table, block=n * block, **one)
        want, _ = single.step(_common(query_lens, seq_lens, table, slots1, **one), q, k, v)
        batch = BatchMetadata.from_lengths(query_lens, seq_lens, table, n * block)
        impl = single.layer.impl
        ref, _ = reference.paged_attention(q, impl._cache, batch, impl.spec)
        tol = impl._impl.backend.capabilities.tolerance(impl.spec.dtype)
        vllm_merged = _vllm_merge(md, dcp, q)
        shard_ok = _holds_shard(dcp, single, table, seq_lens, n, rank, interleave)
        report[f"{tag}-step{i}"] = {
            "vs_single_rank": (got.double() - want.double()).abs().max().item(),
            "vs_reference": (got.double() - ref).abs().max().item(),
            # vLLM's merge as its backends write it: into the layer's output, its dtype
            "vllm_merge_vs_adapter": (vllm_merged.to(got.dtype).double() - got.double())
            .abs()
            .max()
            .item(),
            "tolerance": (tol.atol, tol.rtol),
            "finite": bool(torch.isfinite(got).all()),
            "tokens": t,
            "holds_its_shard": shard_ok,
            "local_seq_lens": md.metas[0].step.shard.seq_lens.tolist(),
            "vllm_local_seq_lens": cm.dcp_local_seq_lens.tolist(),
        }
        torch.testing.assert_close(got, want, atol=tol.atol, rtol=tol.rtol)
        torch.testing.assert_close(got.double(), ref, atol=tol.atol, rtol=tol.rtol)
    return report


def _holds_shard(dcp: _Engine, single: _Engine, table, seq_lens, n, rank, interleave) -> bool:  # type: ignore[no-untyped-def]
    """The rank's cache holds exactly its shard: the single-rank cache's tokens of this rank
    (their keys and values), in its local order."""
    import torch

    from attnhub import reference
    from attnhub.context_parallel import local_seq_lens, token_rank

    cache, s_cache = dcp.layer.impl._cache, single.layer.impl._cache
    local = local_seq_lens(seq_lens, n, rank, interleave)
    for r, s in enumerate(seq_lens):
        mine = torch.from_numpy(token_rank(torch.arange(s), n, interleave) == rank)
        k, v = reference.read_sequence(cache, table[r], int(local[r]))
        k_all, v_all = reference.read_sequence(s_cache, table[r], s)
        if not (torch.equal(k, k_all[mine]) and torch.equal(v, v_all[mine])):
            return False
    return True


def run(rank: int, n: int, job: dict[str, Any]) -> dict:
    """This rank's report (every sub-case's measures); raises where a comparison fails."""
    os.environ["TRITON_INTERPRET"] = "1"  # before vLLM imports Triton
    # the group's shared-memory name, which vLLM's CPU executor sets for its workers
    os.environ["VLLM_DIST_IDENT"] = job["dist_ident"]
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.ops import dcp as vllm_dcp
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    # cp_lse_ag_out_rs's correction kernel, interpreted (this process only)
    kernel = _interpreted(vllm_dcp.CorrectAttnCPOutKernel)
    vllm_dcp.CorrectAttnCPOutKernel.kernel = staticmethod(kernel)  # type: ignore[assignment]

    config = _config(job, n, 1, "ag_rs")
    with set_current_vllm_config(config):
        # the default group is up (the harness's gloo group): vLLM builds its groups on it
        init_worker_distributed_environment(config, rank, None, rank, "gloo")
    from vllm.distributed.parallel_state import get_dcp_group, get_tp_group

    report: dict[str, Any] = {
        "dcp_group": (get_dcp_group().world_size, get_dcp_group().rank_in_group),
        "tp_group": (get_tp_group().world_size, get_tp_group().rank_in_group),
    }
    for interleave, comm in ((1, "ag_rs"), (job["block_size"], "a2a")):
        report.update(_sub_case(rank, n, job, interleave, comm))
    return report
