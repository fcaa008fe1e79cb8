"""What one rank runs in ``test_vllm_mla_dcp.py``: the adapter's MLA layers under vLLM's decode
context parallel, with vLLM's own DCP group and its own MLA DCP helpers, as vLLM's model runner
and ``MLAAttention.forward_impl`` drive them.

Run by ``attnhub_conformance.multi_rank.run_group`` (spawned gloo ranks under a deadline) as the
job's ``extra``: ``run(rank, n, job)``.

On each rank: vLLM's distributed state (``init_worker_distributed_environment``: world, TP and
DCP groups on gloo) for ``tensor_parallel_size = decode_context_parallel_size = N``; the
adapter's MLA impl for this rank's ``Hl`` heads of the tiny DeepSeek-V2 (kv_lora_rank 512, rope
64) and its metadata builder (vLLM's ``MLACommonMetadataBuilder`` subclassed), beside a stand-in
for the layer holding what the builder reads of it (its MLA dimensions and vLLM's own
``MLADCPManager``, which ``MLAAttention`` builds under DCP); then three steps as the model runner
hands them over (vLLM's DCP-local slot mapping from its own Triton kernel, interpreted, and
``get_dcp_local_seq_lens``): first prefills beside a one-token request (a decode whose shard
is empty on rank 1 at interleave 1), then decodes beside a new prefill, then decodes only.
Per step: ``build``, the latent write (``do_kv_cache_update``), and for the decode tokens
what ``forward_impl`` does: ``dcp_manager.query_gather`` of the rank's absorbed query,
``forward_mqa`` (the adapter's partial and LSE over the shard), ``dcp_manager.combine``
(vLLM's ``cp_lse_ag_out_rs`` with its correction kernel interpreted). The
merged latent output of the rank's heads is compared with the single-rank run of the same
attnhub backend over one cache holding every token, with the float64 reference, and with
attnhub's own merge of the same partials (``DecodeContextParallel``'s group ``combine``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

HEADS, R, P, NOPE, V = 4, 512, 64, 32, 32  # the tiny DeepSeek-V2's MLA layer (vllm_generate.py)
#: (query_lens, seq_lens) of the three steps: prefills beside a one-token request (vLLM's MLA
#: builder counts it a decode), then four decodes beside a new prefill (both: the latent write
#: through vLLM's DCP slots), then decodes only (the shard's planned write)
STEPS = [
    ([1, 5, 9, 3], [1, 5, 9, 3]),
    ([1, 1, 1, 1, 7], [2, 6, 10, 4, 7]),
    ([1, 1, 1, 1, 1], [3, 7, 11, 5, 8]),
]


def _config(job: dict[str, Any], interleave: int, comm: str) -> Any:
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig

    n = job["world_size"]
    return VllmConfig(
        model_config=ModelConfig(model=job["model"], dtype=job["dtype"], max_model_len=256),
        cache_config=CacheConfig(block_size=job["block_size"]),
        parallel_config=ParallelConfig(
            tensor_parallel_size=n,
            decode_context_parallel_size=n,
            cp_kv_cache_interleave_size=interleave,
            dcp_comm_backend=comm,
        ),
        additional_config={"attnhub": {"backend": job["backend"], "emulate": job["emulate"]}},
    )


class _Layer:
    """What vLLM's MLA builder and ``forward_mqa`` read of an ``MLAAttention`` layer: its MLA
    dimensions, its impl, its prefill backend (vLLM's choice), its ``_k_scale`` and (under
    DCP) its ``MLADCPManager``, vLLM's own, built with the arguments ``MLAAttention.__init__``
    gives it."""

    def __init__(self, impl: Any, config: Any, dtype: Any) -> None:
        import torch
        from vllm.v1.attention.backends.mla.prefill import get_mla_prefill_backend
        from vllm.v1.attention.ops.dcp import MLADCPManager

        self.impl, self.q_lora_rank, self.kv_lora_rank = impl, None, R
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = NOPE, P, V
        self._k_scale = torch.tensor(1.0, dtype=torch.float32)
        self.num_heads, self.scale = impl.num_heads, impl.scale
        self.prefill_backend = get_mla_prefill_backend(config)(  # as MLAAttention picks it
            num_heads=impl.num_heads, scale=impl.scale, kv_lora_rank=R, qk_nope_head_dim=NOPE,
            qk_rope_head_dim=P, v_head_dim=V, vllm_config=config,
        )  # fmt: skip
        self.dcp_manager = MLADCPManager(
            vllm_config=config, device=torch.device("cpu"), num_heads=impl.num_heads,
            query_head_dim=R + P, output_head_dim=R, query_dtype=dtype, output_dtype=dtype,
            padded_num_heads=None, is_lse_base_on_e=impl.lse_base_on_e, use_pcp=False,
        )  # fmt: skip


def _engine(job: dict[str, Any], config: Any, name: str) -> tuple[Any, Any, Any]:
    """The adapter's MLA impl, the stand-in layer and the adapter's MLA builder on this rank."""
    import torch
    from attnhub_vllm.mla import AttnhubVllmMLAImpl, AttnhubVllmMLAMetadataBuilder
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    n, dtype = job["world_size"], config.model_config.dtype
    with set_current_vllm_config(config):
        impl = AttnhubVllmMLAImpl(
            HEADS // n, R + P, (NOPE + P) ** -0.5, 1, None, None, "auto", None, "decoder", None,
            q_lora_rank=None, kv_lora_rank=R, qk_nope_head_dim=NOPE, qk_rope_head_dim=P,
            qk_head_dim=NOPE + P, v_head_dim=V, kv_b_proj=None,
        )  # fmt: skip
        layer = _Layer(impl, config, dtype)
        config.compilation_config.static_forward_context[name] = layer
        spec = MLAAttentionSpec(
            block_size=job["block_size"], num_kv_heads=1, head_size=R + P, dtype=dtype
        )
        builder = AttnhubVllmMLAMetadataBuilder(spec, [name], config, torch.device("cpu"))
    return impl, layer, builder


def _sub_case(rank: int, n: int, job: dict[str, Any], interleave: int, comm: str) -> dict:
    import torch
    from attnhub_vllm.dcp import DcpLayerStep
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.v1.worker.block_table import ComputeSlotMappingKernel
    from vllm_dcp_rank import _common, _interpreted, _vllm_slots

    from attnhub import BatchMetadata, reference, select_backend
    from attnhub.context_parallel import local_seq_lens
    from attnhub.mla import LatentKVCache
    from attnhub.testing import generator, shuffled_block_table

    kernel = _interpreted(ComputeSlotMappingKernel)
    block, tag = job["block_size"], f"I{interleave}-{comm}"
    config = _config(job, interleave, comm)
    name = f"mla.{tag}.attn"
    impl, layer, builder = _engine(job, config, name)
    dtype = config.model_config.dtype
    assert impl.can_return_lse_for_decode and impl.need_to_return_lse_for_decode
    blocks = job["num_blocks"]
    plane = torch.zeros((blocks, block, R + P), dtype=dtype)  # this rank's shard, vLLM's plane
    # the single-rank run: the same attnhub backend for the group's heads, one cache of
    # N x B blocks holding every token
    full_spec = dataclasses.replace(impl.spec, num_heads=HEADS, block_size=n * block)
    single = select_backend(full_spec, "cpu", prefer=job["backend"], emulate=job["emulate"])
    assert single.name == job["backend"], single
    single_impl, single_builder = single.impl(), single.metadata_builder()
    full = LatentKVCache.from_joint(torch.zeros((blocks, n * block, R + P), dtype=dtype), R)
    table = shuffled_block_table(STEPS[-1][1], n * block, blocks, generator(7)).to(torch.int32)
    heads = slice(rank * impl.num_heads, (rank + 1) * impl.num_heads)
    report: dict[str, Any] = {}
    for i, (query_lens, seq_lens) in enumerate(STEPS):
        g = generator(100 + i)
        t = sum(query_lens)
        q_all = torch.randn((t, HEADS, R + P), generator=g).to(dtype)
        kv_c = torch.randn((t, R), generator=g).to(dtype)
        k_pe = torch.randn((t, 1, P), generator=g).to(dtype)
        local = dict(n=n, rank=rank, interleave=interleave)
        slots = _vllm_slots(kernel, query_lens, seq_lens, table, block=block, **local)
        cm = _common(query_lens, seq_lens, table, slots, **local)
        # vLLM's MLA builder reads the prefills' lengths from the host upper bound (exact here)
        cm = dataclasses.replace(cm, seq_lens_cpu_upper_bound=cm.seq_lens)
        with set_current_vllm_config(config):
            md = builder.build(0, cm)
            with set_forward_context({name: md}, config, slot_mapping={name: slots}):
                # which write the adapter takes: the shard's planned one (decodes only)
                planned = isinstance(impl._decode_step_meta(slots), DcpLayerStep)
                impl.do_kv_cache_update(kv_c, k_pe, plane, slots, "auto", layer._k_scale)
                d = md.num_decode_tokens
                if d:  # MLAAttention.forward_impl's decode under DCP
                    mqa_q = layer.dcp_manager.query_gather(q_all[:d, heads].contiguous())
                    part, lse = impl.forward_mqa(mqa_q, plane, md, layer)
                    # attnhub's own merge of the same partials (vLLM's merges in place)
                    ours, _ = md.attnhub[0].dcp.group.combine(
                        part.clone(), lse.t().contiguous(), empty_rows=md.attnhub[0].step.empty_rows
                    )
                    qsl = md.query_start_loc[: md.num_decodes + 1]
                    got = layer.dcp_manager.combine(
                        part, lse, seq_lens=md.decode.seq_lens, query_start_loc=qsl
                    )
        # the single-rank run of the whole step
        batch = BatchMetadata.from_lengths(query_lens, seq_lens, table[: len(seq_lens)], n * block)
        single_impl.write_kv(kv_c, k_pe.reshape(t, P), full, batch.slot_mapping)
        want = single_impl.forward(q_all, None, None, full, single_builder.build(batch))
        ref, _ = reference.paged_mla_absorbed(q_all, full, batch, full_spec)
        shard = _holds_shard(plane, full, table, seq_lens, n, rank, interleave, block)
        entry: dict[str, Any] = {
            "decode_tokens": d, "holds_its_shard": shard, "planned_write": planned,
            "local_seq_lens": local_seq_lens(seq_lens, n, rank, interleave).tolist(),
            "vllm_local_seq_lens": cm.dcp_local_seq_lens.tolist(),
        }  # fmt: skip
        if d:
            tol = single.capabilities.tolerance(dtype)
            want_r, ref_r = want[:d, heads], ref[:d, heads]
            got = got.to(dtype)
            entry |= {
                "vs_single_rank": (got.double() - want_r.double()).abs().max().item(),
                "vs_reference": (got.double() - ref_r).abs().max().item(),
                "vllm_merge_vs_attnhub_merge": (got.double() - ours.to(dtype).double())
                .abs()
                .max()
                .item(),
                "tolerance": (tol.atol, tol.rtol),
                "finite": bool(torch.isfinite(got).all()),
                "empty_rows": int(md.attnhub[0].step.empty_rows[:d].sum()),
            }
            torch.testing.assert_close(got, want_r, atol=tol.atol, rtol=tol.rtol)
            torch.testing.assert_close(got.double(), ref_r, atol=tol.atol, rtol=tol.rtol)
        report[f"{tag}-step{i}"] = entry
    return report


def _holds_shard(plane, full, table, seq_lens, n, rank, interleave, block) -> bool:  # type: ignore[no-untyped-def]
    """The rank's plane holds exactly its shard: the single-rank cache's latents of this
    rank's tokens, in its local order (vLLM's virtual block b, local slot j: rank block
    ``table[b]``, offset j)."""
    import torch

    from attnhub.context_parallel import local_seq_lens, token_rank

    local = local_seq_lens(seq_lens, n, rank, interleave)
    flat_full = full.joint.reshape(-1, R + P)
    flat = plane.reshape(-1, R + P)
    for r, s in enumerate(seq_lens):
        pos = torch.arange(s)
        mine = pos[torch.from_numpy(token_rank(pos, n, interleave) == rank)]
        full_slots = table[r, pos // (n * block)].long() * n * block + pos % (n * block)
        j = torch.arange(int(local[r]))
        local_slots = table[r, j // block].long() * block + j % block
        if not torch.equal(flat[local_slots], flat_full[full_slots[mine]]):
            return False
    return True


def run(rank: int, n: int, job: dict[str, Any]) -> dict:
    """This rank's report (every sub-case's measures); raises where a comparison fails."""
    os.environ["TRITON_INTERPRET"] = "1"  # before vLLM imports Triton
    os.environ["VLLM_DIST_IDENT"] = job["dist_ident"]
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.ops import dcp as vllm_dcp
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment
    from vllm_dcp_rank import _interpreted

    kernel = _interpreted(vllm_dcp.CorrectAttnCPOutKernel)
    vllm_dcp.CorrectAttnCPOutKernel.kernel = staticmethod(kernel)  # type: ignore[assignment]

    config = _config(job, 1, "ag_rs")
    with set_current_vllm_config(config):
        init_worker_distributed_environment(config, rank, None, rank, "gloo")
    from vllm.distributed.parallel_state import get_dcp_group

    report: dict[str, Any] = {
        "dcp_group": (get_dcp_group().world_size, get_dcp_group().rank_in_group),
    }
    for interleave, comm in job["sub_cases_vllm"]:
        report.update(_sub_case(rank, n, job, interleave, comm))
    return report
