"""Every call form of the Ascend callers that reaches an op attnhub emulates, replayed against the
emulator (and its graph API) in the caller's exact form: its keywords, its positional
arguments, its value kinds (lists, numpy arrays, padded lists), its order of graph calls.

The evidence (``shared/callers/``, each a vendor file flattened to one line):
  - ``vllm-ascend-aclgraph-wrapper.txt`` ("the wrapper"): vllm-ascend's ACL graph wrapper and
    its per-step parameter updates: ``_update_attn_fia_params`` (FIA ``.out`` with
    ``workspace=graph_params.workspaces.get(runtime_shape)``, sparse_mode 3),
    ``update_attn_dcp_pcp_params`` (FIA ``.out``, numpy KV lengths padded with zeros, query
    ends padded by repeating the last), ``update_mla_attn_params`` (FIA ``.out`` with
    ``query_rope``/``key_rope``), and ``ACLGraphWrapper.__call__``'s order: ``synchronize``,
    ``replay``, then the updates, each ending with ``event.record(update_stream)``;
  - ``ascend-vllm-attention-backend.txt`` ("the backend"): an Ascend vLLM backend's
    ``npu_fusion_attention`` calls (TND prefill with a full bool mask, sparse_mode 0; BSND
    chunked prefill per request with a 3-D mask);
  - ``infinicore-ascend-op-cache-attn-pr.txt`` (InfiniCore): ATB ``ReshapeAndCache`` takes int32
    slots ("ATB ReshapeAndCacheParam requires int32 slot_mapping"; its int64 path casts first).

The wrapper's MLA-DCP update (``update_mla_attn_dcp_pcp_params``: ATB's
``torch_npu.atb.npu_multi_head_latent_attention`` with ``return_lse=True``,
``calc_type="calc_type_ring"``, a workspace, ``output=`` / ``lse=``, host context lengths padded
with zeros by ``torch.cat``) is replayed, with its capture's workspace query.

Beyond ``shared/callers``: vllm-ascend 0.23.0's MLA prefill (the released wheel,
``vllm_ascend/attention/mla_v1.py`` ``_forward_prefill``): ``npu_fused_infer_attention_score``
in TND without page attention (``block_table=None``, ``block_size=0``,
``num_key_value_heads=num_heads``, ``sparse_mode=3`` with its mask, ``softmax_lse_flag=True``,
both length lists the cumulative query ends), bfloat16, either with ``query_rope`` /
``key_rope`` (q_nope / k_nope 128 wide) or, with head padding, the parts concatenated
(keys 192) over values 128: both forms replayed.

Not replayed, as attnhub emulates none of these ops: ``npu_incre_flash_attention`` (the
backend's decode), ``_npu_paged_attention`` / ``_npu_paged_attention_get_workspace`` (the
wrapper's PA update). The
MLA FIA form (``query_rope`` / ``key_rope``) is emulated in TND (the wrapper's MTP form); its
BNSD form is valid and refused as not emulated. Each replay is checked against
``attnhub.reference``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from attnhub_ascend import emulator, npu_graph
from attnhub_ascend.emulator import NotEmulatedError, NpuOpError

from attnhub import (
    AttentionSpec,
    BatchMetadata,
    LatentKVCache,
    MLASpec,
    PagedKVCache,
    reference,
    testing,
)
from attnhub.capabilities import Tolerance

FIA_OUT = emulator.npu_fused_infer_attention_score.out
MAX_WS = emulator._npu_fused_infer_attention_score_get_max_workspace
INT_MAX = 2147483647
H, KV_H, D, BS = 4, 2, 64, 128
SCALE = D**-0.5

#: The keywords of each FIA call, exactly as the wrapper passes them.
WRAPPER_FIA_UPDATE = {
    "query", "key", "value", "block_table", "atten_mask", "input_layout", "block_size",
    "actual_seq_lengths", "actual_seq_lengths_kv", "num_key_value_heads", "num_heads", "scale",
    "sparse_mode", "workspace", "out",
}  # fmt: skip
WRAPPER_DCP_UPDATE = {
    "num_heads", "num_key_value_heads", "input_layout", "atten_mask", "scale", "antiquant_mode",
    "antiquant_scale", "softmax_lse_flag", "block_table", "block_size", "actual_seq_lengths_kv",
    "actual_seq_lengths", "workspace", "out",
}  # fmt: skip
BACKEND_FA_PREFILL = {
    "head_num", "input_layout", "scale", "sparse_mode", "atten_mask", "pre_tockens",
    "next_tockens", "actual_seq_qlen", "actual_seq_kvlen",
}  # fmt: skip
BACKEND_FA_CHUNK = {
    "head_num", "input_layout", "scale", "sparse_mode", "atten_mask", "pre_tockens",
    "next_tockens",
}  # fmt: skip


class Paged:
    """A paged cache of random keys/values, (nb, bs, KV_H*D) views as vllm-ascend passes them."""

    def __init__(self, num_blocks: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
        g = testing.generator(seed)
        self.key = torch.randn(num_blocks, BS, KV_H, D, generator=g).to(dtype)
        self.value = torch.randn(num_blocks, BS, KV_H, D, generator=g).to(dtype)
        self.key_view = self.key.view(num_blocks, BS, -1)
        self.value_view = self.value.view(num_blocks, BS, -1)

    def keys(self, table_row: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(n)
        slots = table_row.long()[pos // BS] * BS + pos % BS
        return (
            self.key.view(-1, KV_H, D)[slots],
            self.value.view(-1, KV_H, D)[slots],
        )


def _want(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    out, _ = reference.attention(q, k, v, scale=SCALE, causal=causal)
    return out


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got.double() - want).abs().max().item()
    assert err < 2e-2, f"{what}: max error {err}"


def _keywords(calls: list[Any], name: str) -> list[set[str]]:
    return [set(c.kwargs) for c in calls if c.name == name]


# --- the wrapper: FIA updates and their order ----------------------------------------------------


def test_the_wrappers_fia_update_in_its_order_replay_then_update() -> None:
    """``_update_attn_fia_params`` after ``synchronize(); replay()``, with the capture made as
    vllm-ascend's full-graph FIA path makes it (wait, reset, task group, one max workspace per
    runtime shape)."""
    npu = npu_graph
    cache = Paged(8)
    runtime_shape = 3  # three one-token requests
    block_tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    attn_mask = emulator.compressed_causal_mask()
    query = torch.randn(runtime_shape, H, D, generator=testing.generator(1)).bfloat16()
    attn_output = torch.empty_like(query)
    softmax_lse = torch.empty(1, dtype=query.dtype)  # vllm-ascend's reserved LSE
    workspaces: dict[int, torch.Tensor] = {}
    common: dict[str, Any] = dict(
        block_table=block_tables,
        atten_mask=attn_mask,
        input_layout="TND",
        block_size=BS,
        num_key_value_heads=KV_H,
        num_heads=H,
        scale=SCALE,
        sparse_mode=3,
    )
    capture_lists = dict(actual_seq_lengths=[1, 2, 3], actual_seq_lengths_kv=[5, 6, 7])
    g = npu.NPUGraph()
    event = npu.ExternalEvent()
    with npu.graph(g, pool=npu.graph_pool_handle()):
        stream = npu.current_stream()
        event.wait(stream)
        event.reset(stream)
        workspaces[runtime_shape] = MAX_WS(
            query, cache.key_view, cache.value_view, **common, **capture_lists
        )
        npu.graph_task_group_begin(stream)
        FIA_OUT(
            query,
            cache.key_view,
            cache.value_view,
            **common,
            **capture_lists,
            workspace=workspaces[runtime_shape],
            out=[attn_output, softmax_lse],
        )
        handle = npu.graph_task_group_end(stream)
    update_stream = npu.Stream()
    for step, seq_lens in enumerate(([10, 200, 7], [11, 201, 8], [130, 250, 9])):
        query_start_loc = [1, 2, 3]
        with emulator.record_calls() as calls:
            npu.synchronize()
            g.replay()  # blocks on the event until the update below records it
            with npu.stream(update_stream):
                npu.graph_task_update_begin(update_stream, handle)
                FIA_OUT(
                    query=query,
                    key=cache.key_view,
                    value=cache.value_view,
                    block_table=block_tables,
                    atten_mask=attn_mask,
                    input_layout="TND",
                    block_size=BS,
                    actual_seq_lengths=query_start_loc,
                    actual_seq_lengths_kv=seq_lens,
                    num_key_value_heads=KV_H,
                    num_heads=H,
                    scale=SCALE,
                    sparse_mode=3,
                    workspace=workspaces.get(runtime_shape),
                    out=[attn_output, softmax_lse],
                )
                npu.graph_task_update_end(update_stream)
                event.record(update_stream)
        assert _keywords(calls, "npu_fused_infer_attention_score.out")[0] == WRAPPER_FIA_UPDATE
        for b, n in enumerate(seq_lens):
            k, v = cache.keys(block_tables[b], n)
            _close(attn_output[b : b + 1], _want(query[b : b + 1], k, v, True), f"step {step}")


def test_the_wrappers_dcp_update_numpy_kv_lengths_and_repeated_query_ends() -> None:
    """``update_attn_dcp_pcp_params``: KV lengths a numpy array padded with zeros, query ends
    padded by repeating the last over a query of the runtime shape, no mask (sparse_mode 0),
    the LSE flag set."""
    cache = Paged(8)
    runtime_shape, num_decodes = 4, 2
    q_nope = torch.randn(runtime_shape, H, D, generator=testing.generator(2)).bfloat16()
    block_table = torch.tensor([[0, 1], [2, 3], [0, 0], [0, 0]], dtype=torch.int32)
    actual_seq_lengths_kv = np.array([9, 140], dtype=np.int32)
    pad_length = runtime_shape - len(actual_seq_lengths_kv)
    pad_tensor = np.zeros(pad_length, dtype=actual_seq_lengths_kv.dtype)
    actual_seq_lengths_kv = np.concatenate([actual_seq_lengths_kv, pad_tensor])
    actual_seq_lengths_q = [1, 2][:num_decodes]
    actual_seq_lengths_q = actual_seq_lengths_q + [actual_seq_lengths_q[-1]] * (
        runtime_shape - len(actual_seq_lengths_q)
    )
    attn_out = torch.empty_like(q_nope)
    attn_lse = torch.empty((runtime_shape, H, 1), dtype=torch.float)
    kwargs: dict[str, Any] = dict(
        num_heads=H,
        num_key_value_heads=KV_H,
        input_layout="TND",
        atten_mask=None,
        scale=SCALE,
        antiquant_mode=0,
        antiquant_scale=None,
        softmax_lse_flag=True,
        block_table=block_table,
        block_size=BS,
        actual_seq_lengths_kv=actual_seq_lengths_kv,
        actual_seq_lengths=actual_seq_lengths_q,
    )
    workspace = MAX_WS(q_nope, cache.key_view, cache.value_view, **kwargs)
    with emulator.record_calls() as calls:
        FIA_OUT(
            q_nope,
            cache.key_view,
            cache.value_view,
            num_heads=H,
            num_key_value_heads=KV_H,
            input_layout="TND",
            atten_mask=None,
            scale=SCALE,
            antiquant_mode=0,
            antiquant_scale=None,
            softmax_lse_flag=True,
            block_table=block_table,
            block_size=BS,
            actual_seq_lengths_kv=actual_seq_lengths_kv,
            actual_seq_lengths=actual_seq_lengths_q,
            workspace=workspace,
            out=[attn_out, attn_lse],
        )
    assert _keywords(calls, "npu_fused_infer_attention_score.out")[0] == WRAPPER_DCP_UPDATE
    for b in range(num_decodes):
        k, v = cache.keys(block_table[b], int(actual_seq_lengths_kv[b]))
        want, lse = reference.attention(q_nope[b : b + 1], k, v, scale=SCALE, causal=False)
        _close(attn_out[b : b + 1], want, f"decode {b}")
        assert torch.allclose(attn_lse[b, :, 0].double(), lse[:, 0], atol=1e-3)
    # the rows past the last query end belong to no request: nothing a caller may read
    assert attn_out[num_decodes:].isnan().all()


def _wrapper_mla_update(layout: str, sparse_mode: int, mask: Any, **lists: Any) -> Any:
    """update_mla_attn_params' FIA call, keyword for keyword: q_nope, k_nope, k_nope with
    query_rope / key_rope, DeepSeek's MLA shapes (N 32, D 512 + 64, one KV head), the planes
    viewed (num_blocks, 1, block_size, D) as vllm-ascend views them."""
    g = testing.generator(11)
    N, R, P, nb = 32, 512, 64, 4
    T = lists.pop("T")
    k_nope = torch.randn(nb, 1, BS, R, generator=g).bfloat16()
    k_pe = torch.randn(nb, 1, BS, P, generator=g).bfloat16()
    shape = (T, N, 1) if layout == "BNSD" else (T, N)
    q_nope = torch.randn(*shape, R, generator=g).bfloat16()
    q_pe = torch.randn(*shape, P, generator=g).bfloat16()
    attn_output = torch.empty_like(q_nope)
    softmax_lse = torch.empty(T, dtype=q_nope.dtype)  # the wrapper's: reserved, query dtype
    FIA_OUT(
        q_nope,
        k_nope,
        k_nope,
        query_rope=q_pe,
        key_rope=k_pe,
        num_heads=N,
        num_key_value_heads=1,
        input_layout=layout,
        atten_mask=mask,
        sparse_mode=sparse_mode,
        scale=SCALE,
        antiquant_mode=0,
        antiquant_scale=None,
        block_table=lists["block_table"],
        block_size=BS,
        actual_seq_lengths_kv=lists["seq_lens_list"],
        actual_seq_lengths=lists["actual_seq_lengths"],
        workspace=None,
        out=[attn_output, softmax_lse],
    )
    return q_nope, q_pe, k_nope, k_pe, attn_output


def test_the_wrappers_mla_update_with_speculative_tokens_in_tnd() -> None:
    """update_mla_attn_params under MTP: TND, sparse_mode 3 with the spec mask, query ends
    ``spec_multiple * (i + 1)`` over the whole capture size, ``seq_lens_list`` padded with 0."""
    spec_multiple, runtime_shape, real = 2, 6, [130, 7]
    table = torch.tensor([[2, 0], [1, 3], [0, 0]], dtype=torch.int32)
    q_nope, q_pe, k_nope, k_pe, out = _wrapper_mla_update(
        "TND",
        3,
        emulator.compressed_causal_mask(),
        T=runtime_shape,
        block_table=table,
        seq_lens_list=real + [0] * (runtime_shape // spec_multiple - len(real)),
        actual_seq_lengths=[spec_multiple * (i + 1) for i in range(runtime_shape // spec_multiple)],
    )
    spec = MLASpec(
        num_heads=32,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        block_size=BS,
        scale=SCALE,
    )
    cache = LatentKVCache(
        kv_c=k_nope.view(-1, BS, 512), k_pe=k_pe.view(-1, BS, 64), block_size=BS, layout="split"
    )
    batch = BatchMetadata.from_lengths([2, 2], real, table[:2], BS)
    query = torch.cat([q_nope, q_pe], dim=-1)[:4]
    want, _ = reference.paged_mla_absorbed(query, cache, batch, spec)
    assert testing.mismatch(out[:4], want, Tolerance(atol=2e-2, rtol=2e-2)) is None
    # the padding request (KV length 0, 2 query tokens, sparse_mode 3): the op's own
    # correction of rows that see no key ("sparse_mode=3且Q_S > KV_S") gives 0
    assert bool((out[4:] == 0).all())


def test_the_wrappers_mla_update_in_bnsd_is_valid_but_not_emulated() -> None:
    """update_mla_attn_params without speculative tokens: BNSD, sparse_mode 0, no mask: a
    layout the MLA form allows, refused as not emulated (never as a vendor error)."""
    with pytest.raises(NotEmulatedError, match="BNSD"):
        _wrapper_mla_update(
            "BNSD",
            0,
            None,
            T=2,
            block_table=torch.tensor([[0], [1]], dtype=torch.int32),
            seq_lens_list=[3, 4],
            actual_seq_lengths=None,
        )


def test_the_wrappers_mla_dcp_update_atbs_mla_op_with_its_lse() -> None:
    """update_mla_attn_dcp_pcp_params, in its exact form: the capture's workspace query
    (``_npu_multi_head_latent_attention_get_workspace(..., return_lse=True,
    calc_type="calc_type_ring")``), then per step ``npu_multi_head_latent_attention(q_nope, q_pe,
    k_nope, k_pe, block_table, seq_len, num_heads, scale, num_kv_heads, return_lse=True,
    calc_type="calc_type_ring", workspace=, output=, lse=)`` with ``seq_len`` the per-rank
    context lengths padded with zeros to the capture size (``torch.cat`` on their host device),
    ``output`` ``empty_like(q_nope)`` and ``lse`` ``[T, H, 1]`` in q_nope's dtype."""
    g = testing.generator(12)
    runtime_shape, real, heads, nb = 4, [130, 7], 32, 4
    q_nope = torch.randn(runtime_shape, heads, 512, generator=g).bfloat16()
    q_pe = torch.randn(runtime_shape, heads, 64, generator=g).bfloat16()
    # the wrapper's views: k_nope.view(-1, block_size, num_kv_heads, kv_lora_rank)
    k_nope = torch.randn(nb, BS, 1, 512, generator=g).bfloat16()
    k_pe = torch.randn(nb, BS, 1, 64, generator=g).bfloat16()
    block_table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)  # the real decodes' rows
    seq_len = torch.tensor(real, dtype=torch.int32)
    pad_length = runtime_shape - len(seq_len)
    pad_tensor = torch.zeros(pad_length, dtype=seq_len.dtype, device=seq_len.device)
    seq_len = torch.cat([seq_len, pad_tensor], dim=0)
    atb = emulator.atb
    workspace = atb._npu_multi_head_latent_attention_get_workspace(
        q_nope, q_pe, k_nope, k_pe, block_table, seq_len, heads, SCALE, 1,
        return_lse=True, calc_type="calc_type_ring",
    )  # fmt: skip
    attn_output = torch.empty_like(q_nope)
    softmax_lse = torch.empty((runtime_shape, heads, 1), dtype=q_nope.dtype)
    atb.npu_multi_head_latent_attention(
        q_nope, q_pe, k_nope, k_pe, block_table, seq_len, heads, SCALE, 1,
        return_lse=True, calc_type="calc_type_ring", workspace=workspace,
        output=attn_output, lse=softmax_lse,
    )  # fmt: skip
    spec = MLASpec(
        num_heads=heads,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        block_size=BS,
        scale=SCALE,
    )
    cache = LatentKVCache(
        kv_c=k_nope.view(-1, BS, 512), k_pe=k_pe.view(-1, BS, 64), block_size=BS, layout="split"
    )
    batch = BatchMetadata.from_lengths([1, 1], real, block_table, BS)
    query = torch.cat([q_nope, q_pe], dim=-1)[:2]
    want, want_lse = reference.paged_mla_absorbed(query, cache, batch, spec)
    tol = Tolerance(atol=2e-2, rtol=2e-2)
    assert testing.mismatch(attn_output[:2], want, tol) is None
    assert testing.mismatch(softmax_lse[:2, :, 0], want_lse.t(), tol) is None
    # the padded entries (context 0) the wrapper overwrites itself (batch_seq_mask): not defined
    assert bool(softmax_lse[2:].isnan().all())


@pytest.mark.parametrize("head_padding", [False, True], ids=["rope-form", "concatenated"])
def test_vllm_ascends_mla_prefill_fia_in_tnd_without_page_attention(head_padding: bool) -> None:
    """vllm-ascend 0.23.0's ``_forward_prefill``, in its exact keywords: ``common_kwargs`` with
    ``actual_seq_lengths_kv = actual_seq_lengths_q.copy()``, then FIA with ``query_rope`` /
    ``key_rope`` (``k_pe.contiguous()``), or, with head padding, ``cat((q_nope, q_pe))`` and
    ``cat((k_nope, k_pe))`` as query and key; ``key.contiguous()``, ``value.contiguous()``."""
    g = testing.generator(13)
    heads, query_lens = 4, [5, 3]
    T = sum(query_lens)
    q_nope = torch.randn(T, heads, 128, generator=g).bfloat16()
    q_pe = torch.randn(T, heads, 64, generator=g).bfloat16()
    k_nope = torch.randn(T, heads, 128, generator=g).bfloat16()
    k_pe = torch.randn(T, heads, 64, generator=g).bfloat16()
    value = torch.randn(T, heads, 128, generator=g).bfloat16()
    actual_seq_lengths_q = np.cumsum(query_lens).tolist()
    actual_seq_lengths_kv = actual_seq_lengths_q.copy()
    common_kwargs: dict[str, Any] = {
        "num_heads": heads,
        "num_key_value_heads": heads,
        "input_layout": "TND",
        "atten_mask": emulator.compressed_causal_mask(),
        "sparse_mode": 3,
        "scale": SCALE,
        "antiquant_mode": 0,
        "antiquant_scale": None,
        "block_table": None,
        "block_size": 0,
        "softmax_lse_flag": True,
        "actual_seq_lengths": actual_seq_lengths_q,
        "actual_seq_lengths_kv": actual_seq_lengths_kv,
    }
    if head_padding:
        query = torch.cat((q_nope, q_pe), dim=-1)
        key = torch.cat((k_nope, k_pe), dim=-1)
    else:
        common_kwargs["query_rope"] = q_pe
        common_kwargs["key_rope"] = k_pe.contiguous()
        query, key = q_nope, k_nope
    attn_output, attn_lse = emulator.npu_fused_infer_attention_score(
        query, key.contiguous(), value.contiguous(), **common_kwargs
    )
    spec = AttentionSpec(
        num_heads=heads, num_kv_heads=heads, head_size=192, head_size_v=128,
        dtype=torch.bfloat16, block_size=BS,
        scale=SCALE,
    )  # fmt: skip
    q_all, k_all = torch.cat((q_nope, q_pe), -1), torch.cat((k_nope, k_pe), -1)
    table = torch.zeros(1, 1, dtype=torch.int32)
    outs, lses, start = [], [], 0
    for ql in query_lens:  # each request over its own keys, in the reference
        c = PagedKVCache.allocate(1, BS, heads, 192, torch.bfloat16, head_size_v=128)
        c.key[0, :ql] = k_all[start : start + ql]
        c.value[0, :ql] = value[start : start + ql]
        b = BatchMetadata.from_lengths([ql], [ql], table, BS)
        o, lse = reference.paged_attention(q_all[start : start + ql], c, b, spec)
        outs.append(o)
        lses.append(lse)
        start += ql
    tol = Tolerance(atol=2e-2, rtol=2e-2)
    assert testing.mismatch(attn_output, torch.cat(outs), tol) is None
    assert testing.mismatch(attn_lse[:, :, 0], torch.cat(lses, dim=1).t(), tol) is None


# --- an Ascend vLLM backend's npu_fusion_attention calls -----------------------------------------


def test_the_backends_prefill_without_cache_tnd_with_a_full_bool_mask() -> None:
    """``_forward_prefill_no_cache``: TND, sparse_mode=0, atten_mask = ones(max_seq, max_seq)
    .triu_(1) (bool), pre_tockens=2147483647, next_tockens=0, cumulative lengths."""
    g = testing.generator(3)
    seq_lens = [5, 9, 2]
    num_tokens = sum(seq_lens)
    query = torch.randn(num_tokens + 2, H, D, generator=g).half()  # 2 padding rows after
    key = torch.randn(num_tokens + 2, KV_H, D, generator=g).half()
    value = torch.randn(num_tokens + 2, KV_H, D, generator=g).half()
    max_seq = max(seq_lens)
    attn_mask = torch.ones(max_seq, max_seq, dtype=torch.bool).triu_(diagonal=1)
    cum_seq_len = np.cumsum(seq_lens).tolist()
    with emulator.record_calls() as calls:
        attn_out = emulator.npu_fusion_attention(
            query[:num_tokens],
            key[:num_tokens],
            value[:num_tokens],
            head_num=H,
            input_layout="TND",
            scale=SCALE,
            sparse_mode=0,
            atten_mask=attn_mask,
            pre_tockens=2147483647,
            next_tockens=0,
            actual_seq_qlen=cum_seq_len,
            actual_seq_kvlen=cum_seq_len,
        )
    assert _keywords(calls, "npu_fusion_attention")[0] == BACKEND_FA_PREFILL
    start = 0
    for n in seq_lens:
        rows = slice(start, start + n)
        _close(attn_out[0][rows], _want(query[rows], key[rows], value[rows], True), f"len {n}")
        start += n


@pytest.mark.parametrize("context", [True, False], ids=["gathered context", "no context"])
def test_the_backends_chunked_prefill_bsnd_with_a_3d_mask(context: bool) -> None:
    """``_forward_chunked_prefill``, per request: BSND (``unsqueeze(0)``), sparse_mode=0,
    atten_mask = ``ones(q_len, kv_len).triu_(kv_len - q_len + 1).unsqueeze(0)`` (3-D bool),
    pre_tockens = kv_len (q_len without context), next_tockens=0."""
    g = testing.generator(4)
    q_len, kv_len = (3, 140) if context else (6, 6)
    q = torch.randn(q_len, H, D, generator=g).bfloat16()
    gathered_k = torch.randn(kv_len, KV_H, D, generator=g).bfloat16()
    gathered_v = torch.randn(kv_len, KV_H, D, generator=g).bfloat16()
    causal_mask = torch.ones(q_len, kv_len, dtype=torch.bool).triu_(diagonal=kv_len - q_len + 1)
    with emulator.record_calls() as calls:
        attn_out = emulator.npu_fusion_attention(
            q.unsqueeze(0),
            gathered_k.unsqueeze(0),
            gathered_v.unsqueeze(0),
            head_num=H,
            input_layout="BSND",
            scale=SCALE,
            sparse_mode=0,
            atten_mask=causal_mask.unsqueeze(0),
            pre_tockens=kv_len,
            next_tockens=0,
        )
    assert _keywords(calls, "npu_fusion_attention")[0] == BACKEND_FA_CHUNK
    assert attn_out[0].shape == (1, q_len, H, D)
    _close(attn_out[0].squeeze(0), _want(q, gathered_k, gathered_v, True), "chunk")


# --- InfiniCore: ATB ReshapeAndCache -------------------------------------------------------------


def test_reshape_and_cache_takes_the_int32_slots_infinicore_casts_to() -> None:
    # "ATB ReshapeAndCacheParam requires int32 slot_mapping": int64 is cast on the stream first
    cache = Paged(2, dtype=torch.float16)
    key = torch.randn(3, KV_H, D).half()
    value = torch.randn(3, KV_H, D).half()
    slots = torch.tensor([5, -1, 130], dtype=torch.int64)
    before = cache.key.clone()
    with pytest.raises(NpuOpError, match="int32"):
        emulator._npu_reshape_and_cache(key, value, cache.key, cache.value, slots)
    assert torch.equal(cache.key, before)
    emulator._npu_reshape_and_cache(key, value, cache.key, cache.value, slots.to(torch.int32))
    flat = cache.key.view(-1, KV_H, D)
    assert torch.equal(flat[5], key[0]) and torch.equal(flat[130], key[2])
    assert math.isfinite(float(cache.value.float().sum()))
