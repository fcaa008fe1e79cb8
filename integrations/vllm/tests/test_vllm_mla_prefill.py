"""The adapter's MLA prefill (``AttnhubVllmMLAImpl.forward_mha``): vLLM's expanded form through
the attnhub backend's standard impl (``attnhub_vllm.mla_prefill``), driven as vLLM's
``MLAAttention.forward_impl`` drives it: the adapter's MLA impl and metadata builder (vLLM's
``MLACommonMetadataBuilder`` subclassed) build a step of decodes and prefills from vLLM's
``CommonAttentionMetadata``; ``forward_mha`` gets the prefill tokens' query, latents and output.

Checked against ``attnhub.reference`` (the expanded form per request, and the absorbed form
projected by ``W_UV``: the same attention), against vLLM's own ``forward_mha`` (its CPU prefill
backend), for ``torch`` (the tiny DeepSeek-V2's 96 / 32) and the emulated ``flash``
(``vllm-fa3``) and ``ascend`` at DeepSeek's 192 / 128 in bfloat16; where the backend refuses the
expanded geometry, the prefill is vLLM's own, with the backend's reason. Prefills with cached
context (a chunked prefill's earlier chunks, a prefix-cache hit) read it from the layer's latent
cache through attnhub (joint or split planes, fp8 dequantized), expanded by ``kv_b_proj``,
checked against the same references over the whole sequence and against vLLM's own
``forward_mha`` with its context gather; context sharded over decode context parallel ranks
and bad input are refused with typed errors.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import weakref
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (nox -s vllm)"
)

R, P = 512, 64  # the latent (kv_lora_rank, rope) of DeepSeek and of the tiny model
TINY = dict(heads=4, nope=32, v=32)  # the tiny DeepSeek-V2 (vllm_generate.py): keys 96, values 32
DEEPSEEK = dict(heads=32, nope=128, v=128)  # DeepSeek's per-head sizes: keys 192, values 128
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: (query_lens, seq_lens): two decodes (vLLM's builder puts them first) beside three prefills
STEP = ([1, 1, 5, 17, 3], [9, 4, 5, 17, 3])


def _model() -> str:
    from vllm_generate import tiny_deepseek_v2_once  # this directory: pytest's rootdir insertion

    return tiny_deepseek_v2_once()


def _use_vllm_fa3(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``flash`` backend served by provider ``vllm-fa3`` for this test, as a process started
    with ``ATTNHUB_FLASH_PROVIDER=vllm-fa3`` has it: a fresh registry (the plugin registers the
    provider's class when discovered) and the adapter's per-process backends emptied."""
    pytest.importorskip("attnhub_flash")
    import attnhub_vllm.backend as adapter

    import attnhub.registry as registry

    monkeypatch.setenv("ATTNHUB_FLASH_PROVIDER", "vllm-fa3")
    monkeypatch.setattr(registry, "_REGISTRY", registry.Registry())
    monkeypatch.setattr(adapter, "_BACKENDS", {})


class _KvBProj(torch.nn.Module):
    """``kv_b_proj`` as vLLM's linear layers are called: ``(x @ W.T, bias)``, its output per
    head ``[k_nope ; v]`` (vLLM's split in ``process_weights_after_loading``)."""

    quant_method = None  # unquantized (what vLLM's get_and_maybe_dequant_weights reads)

    def __init__(self, w_uk: torch.Tensor, w_uv: torch.Tensor) -> None:
        super().__init__()
        heads = w_uk.shape[1]
        self.weight = torch.cat([w_uk, w_uv], dim=-1).reshape(R, -1).t().contiguous()
        assert self.weight.shape[0] == heads * (w_uk.shape[2] + w_uv.shape[2])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(x, self.weight), None


class _Layer:
    """What vLLM's MLA builder reads of an ``MLAAttention`` layer (its MLA dimensions, its
    impl, its prefill backend: vLLM's choice, as ``MLAAttention`` picks it)."""

    def __init__(self, impl: Any, config: Any, nope: int, v: int) -> None:
        from vllm.v1.attention.backends.mla.prefill import get_mla_prefill_backend

        self.impl, self.q_lora_rank, self.kv_lora_rank = impl, None, R
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = nope, P, v
        self._k_scale = torch.tensor(1.0, dtype=torch.float32)
        self.num_heads, self.scale = impl.num_heads, impl.scale
        self.prefill_backend = get_mla_prefill_backend(config)(
            num_heads=impl.num_heads, scale=impl.scale, kv_lora_rank=R, qk_nope_head_dim=nope,
            qk_rope_head_dim=P, v_head_dim=v, vllm_config=config,
        )  # fmt: skip


@dataclasses.dataclass
class Engine:
    impl: Any
    layer: _Layer
    builder: Any
    config: Any
    w_uk: torch.Tensor
    w_uv: torch.Tensor


def _engine(
    backend: str,
    dtype: str,
    geometry: dict[str, int],
    *,
    emulate: bool = False,
    block: int = 16,
    context: bool = False,
) -> Engine:
    """The adapter's MLA impl (random ``kv_b_proj``), the stand-in layer and the adapter's MLA
    builder, as vLLM builds them for one layer."""
    from attnhub_vllm.mla import AttnhubVllmMLAImpl, AttnhubVllmMLAMetadataBuilder
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from attnhub.testing import generator

    heads, nope, v = geometry["heads"], geometry["nope"], geometry["v"]
    torch_dtype = DTYPES[dtype]
    g = generator(11)
    w_uk = (torch.randn((R, heads, nope), generator=g) / R**0.5).to(torch_dtype)
    w_uv = (torch.randn((R, heads, v), generator=g) / R**0.5).to(torch_dtype)
    config = VllmConfig(
        model_config=ModelConfig(model=_model(), dtype=dtype, max_model_len=256),
        cache_config=CacheConfig(block_size=block),
        device_config=DeviceConfig(device="cpu"),
        additional_config={"attnhub": {"backend": backend, "emulate": emulate}},
    )
    # the block asked for (vLLM's CPU platform forces 16 for MLA models where it does not pick
    # AMX_MLA, as here without AMX tiles)
    config.cache_config.block_size = block
    # as vLLM's CPU platform sets them for MLA models (AMX_MLA aside): no cached context
    config.scheduler_config.enable_chunked_prefill = context
    config.cache_config.enable_prefix_caching = context
    name = f"mla.{backend}.{dtype}.{heads}.attn"
    with set_current_vllm_config(config):
        impl = AttnhubVllmMLAImpl(
            heads, R + P, (nope + P) ** -0.5, 1, None, None, "auto", None, "decoder", None,
            q_lora_rank=None, kv_lora_rank=R, qk_nope_head_dim=nope, qk_rope_head_dim=P,
            qk_head_dim=nope + P, v_head_dim=v, kv_b_proj=_KvBProj(w_uk, w_uv),
        )  # fmt: skip
        layer = _Layer(impl, config, nope, v)
        config.compilation_config.static_forward_context[name] = layer
        kv_spec = MLAAttentionSpec(
            block_size=block, num_kv_heads=1, head_size=R + P, dtype=torch_dtype
        )
        builder = AttnhubVllmMLAMetadataBuilder(kv_spec, [name], config, torch.device("cpu"))
    return Engine(impl, layer, builder, config, w_uk, w_uv)


def _common(query_lens: list[int], seq_lens: list[int], block: int) -> Any:
    """vLLM's ``CommonAttentionMetadata`` of a step (a shuffled block table, the slots of the
    new tokens)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from attnhub import BatchMetadata
    from attnhub.testing import generator, shuffled_block_table

    table = shuffled_block_table(seq_lens, block, 64, generator(3)).to(torch.int32)
    batch = BatchMetadata.from_lengths(query_lens, seq_lens, table, block)
    qsl = batch.query_start_loc_cpu
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq,
        num_reqs=len(query_lens), num_actual_tokens=int(qsl[-1]),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_table_tensor=table,
        slot_mapping=batch.slot_mapping, causal=True, seq_lens_cpu_upper_bound=seq,
    )  # fmt: skip


@dataclasses.dataclass
class Prefill:
    md: Any  # the adapter's metadata of the step
    q: torch.Tensor  # [prefill tokens, H, nope + rope]
    kv_c: torch.Tensor  # [prefill tokens, R]
    k_pe: torch.Tensor  # [prefill tokens, 1, P]
    plane: torch.Tensor  # vLLM's latent plane of the layer (random: the cached context)
    query_lens: list[int]
    context_lens: list[int]  # per prefill
    block_table: torch.Tensor | None  # vLLM's rows of the prefills

    def context(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill ``r``'s cached context as the plane holds it (kv_c [c, R], k_pe [c, P])."""
        c = self.context_lens[r]
        assert self.block_table is not None or c == 0
        if c == 0:
            return self.plane.new_zeros((0, R)), self.plane.new_zeros((0, P))
        assert self.block_table is not None
        bs = self.plane.shape[1]
        pos = torch.arange(c)
        rows = self.plane[self.block_table[r].long()[pos // bs], pos % bs]
        return rows[:, :R], rows[:, R:]


def _prefill(engine: Engine, step: tuple[list[int], list[int]] = STEP, seed: int = 5) -> Prefill:
    """The step built by the adapter's builder, and its prefill tokens' inputs."""
    from vllm.config import set_current_vllm_config

    from attnhub.testing import generator

    query_lens, seq_lens = step
    impl, dtype = engine.impl, engine.w_uk.dtype
    block = engine.builder.block_size
    with set_current_vllm_config(engine.config):
        md = engine.builder.build(0, _common(query_lens, seq_lens, block))
    d = md.num_decode_tokens
    n = sum(query_lens) - d
    g = generator(seed)
    q = torch.randn((n, impl.num_heads, impl.qk_nope_head_dim + P), generator=g).to(dtype)
    kv_c = torch.randn((n, R), generator=g).to(dtype)
    k_pe = torch.randn((n, 1, P), generator=g).to(dtype)
    # vLLM's latent plane: random latents (a prefill's cached context is read from it)
    plane = torch.randn((64, block, R + P), generator=g).to(dtype)
    prefill = md.prefill
    table = None if prefill is None else prefill.block_table
    ctx = [s - q_ for q_, s in zip(query_lens, seq_lens, strict=True)][md.num_decodes :]
    return Prefill(md, q, kv_c, k_pe, plane, query_lens[md.num_decodes :], ctx, table)


def _forward_mha(engine: Engine, p: Prefill, *, vllms: bool = False) -> torch.Tensor:
    """``forward_mha`` as ``forward_impl`` calls it (its output rows: ``[T, H * v]``); with
    ``vllms``, vLLM's own (``MLACommonBaseImpl.forward_mha``) on the same impl."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonBaseImpl

    impl = engine.impl
    out = torch.full((p.q.shape[0], impl.num_heads * impl.v_head_dim), float("nan"))
    out = out.to(p.q.dtype)
    call = MLACommonBaseImpl.forward_mha if vllms else type(impl).forward_mha
    call(impl, p.q, p.kv_c, p.k_pe, p.plane, p.md, engine.layer._k_scale, output=out)
    return out.view(-1, impl.num_heads, impl.v_head_dim)


def _references(engine: Engine, p: Prefill) -> tuple[torch.Tensor, torch.Tensor]:
    """float64: the expanded form per request, and the absorbed form projected by W_UV."""
    from attnhub import reference

    impl = engine.impl
    expanded, absorbed = [], []
    start = 0
    for r, n in enumerate(p.query_lens):
        q = p.q[start : start + n]
        ctx_c, ctx_pe = p.context(r)  # the whole sequence: cached context, then the new tokens
        kv_c = torch.cat([ctx_c, p.kv_c[start : start + n]])
        k_pe = torch.cat([ctx_pe, p.k_pe[start : start + n, 0]])
        out, _ = reference.mla_expanded(q, kv_c, k_pe, engine.w_uk, engine.w_uv, scale=impl.scale)
        expanded.append(out)
        q_nope, q_pe = q.split([impl.qk_nope_head_dim, P], dim=-1)
        ql = torch.cat([reference.absorb_query(q_nope, engine.w_uk), q_pe.double()], dim=-1)
        lat, _ = reference.mla_absorbed(ql, kv_c, k_pe, scale=impl.scale)
        absorbed.append(reference.mla_output(lat, engine.w_uv))
        start += n
    return torch.cat(expanded), torch.cat(absorbed)


# --- who serves the prefill ------------------------------------------------------------------


def test_torch_serves_the_tiny_models_expanded_prefill() -> None:
    engine = _engine("torch", "bfloat16", TINY)
    route = engine.impl.prefill_route
    assert route.backend is not None and route.backend.name == "torch", route
    spec = route.spec
    assert (spec.num_heads, spec.num_kv_heads, spec.head_size, spec.head_size_v) == (4, 4, 96, 32)
    assert spec.causal and spec.scale == engine.impl.scale and spec.dtype == torch.bfloat16
    assert "attnhub (the expanded form" in route.why


def test_a_backend_that_refuses_the_expanded_geometry_leaves_the_prefill_to_vllm() -> None:
    """``cpu`` declares no value head size of its own: its reason, and vLLM's own output."""
    pytest.importorskip("attnhub_cpu")
    import attnhub

    cls = attnhub.get_backend("cpu")
    if cls.availability("cpu") is not None:
        pytest.skip(f"cpu backend unavailable: {cls.availability('cpu')}")
    engine = _engine("cpu", "float32", TINY)
    route = engine.impl.prefill_route
    assert route.backend is None
    assert route.why.startswith("vLLM's own (MLACommonBaseImpl.forward_mha): ")
    assert "vLLM's CPU kernels take one head_dim for query, key and value" in route.why
    p = _prefill(engine)
    assert p.md.attnhub_prefill == [None]
    got, want = _forward_mha(engine, p), _forward_mha(engine, p, vllms=True)
    assert torch.equal(got, want)


def test_an_engine_that_may_send_cached_context_routes_the_prefill_to_attnhub() -> None:
    """Chunked prefill or prefix caching on (vLLM's CPU platform leaves them on with
    ``AMX_MLA``): attnhub serves the prefill, reading cached context from the latent cache."""
    engine = _engine("torch", "float32", TINY, context=True)
    route = engine.impl.prefill_route
    assert route.backend is not None and route.backend.name == "torch", route
    assert "cached context read from the latent cache and expanded by kv_b_proj" in route.why


def test_context_sharded_over_decode_context_parallel_ranks_keeps_vllms_prefill() -> None:
    """Under decode context parallel a rank's latent cache holds a shard of the context (vLLM
    gathers it over the group): an engine that may send context keeps vLLM's own prefill."""
    from attnhub_vllm import mla_prefill

    engine = _engine("torch", "float32", TINY)
    spec = engine.impl.spec
    mla_backend = engine.builder._attnhub_builders[0].backend
    route = mla_prefill.prefill_route(mla_backend, spec, "cpu", False, sharded_context=True)
    assert route.backend is None
    assert "sharded over the decode context parallel group" in route.why, route.why


def test_flash_refuses_the_tiny_models_96_32_with_its_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _use_vllm_fa3(monkeypatch)
    engine = _engine("flash", "bfloat16", TINY, emulate=True)
    route = engine.impl.prefill_route
    assert route.backend is None, route
    assert "head_size_v 32" in route.why and "head_size 96" in route.why, route.why


# --- the prefill through attnhub ---------------------------------------------------------------


def _check(engine: Engine, p: Prefill, got: torch.Tensor) -> None:
    tol = engine.impl.prefill_route.backend.capabilities.tolerance(p.q.dtype)
    expanded, absorbed = _references(engine, p)
    torch.testing.assert_close(expanded, absorbed, atol=1e-9, rtol=1e-9)  # one attention
    torch.testing.assert_close(got.double(), expanded, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_torch_prefill_matches_the_reference_and_vllms_own(dtype: str) -> None:
    engine = _engine("torch", dtype, TINY)
    p = _prefill(engine)
    assert p.md.num_decodes == 2 and p.query_lens == [5, 17, 3]
    got = _forward_mha(engine, p)
    _check(engine, p, got)
    vllms = _forward_mha(engine, p, vllms=True)  # vLLM's CPU prefill backend (an SDPA)
    tol = engine.impl.prefill_route.backend.capabilities.tolerance(p.q.dtype)
    torch.testing.assert_close(got, vllms, atol=tol.atol, rtol=tol.rtol)
    assert not torch.equal(got, torch.zeros_like(got))


def test_flash_vllm_fa3_serves_deepseeks_192_128_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    """FA3's varlen kernel with a value head size of its own (emulated), as vLLM's
    FLASH_ATTN_MLA runs DeepSeek's prefill."""
    _use_vllm_fa3(monkeypatch)
    engine = _engine("flash", "bfloat16", DEEPSEEK, emulate=True)
    route = engine.impl.prefill_route
    assert route.backend is not None and route.backend.name == "flash", route
    assert (route.spec.head_size, route.spec.head_size_v) == (192, 128)
    p = _prefill(engine)
    _check(engine, p, _forward_mha(engine, p))


def test_the_prefill_goes_to_the_mla_backends_own_class_and_emulation() -> None:
    """Regression: the route looked the expanded backend up by name, so a flash MLA layer on
    provider ``vllm-fa3`` got the registry's default provider (vLLM's fork's FA2, which takes
    one head size: vLLM's own prefill), and an emulated layer made without ``emulate=`` (the
    engine's ``ATTNHUB_EMULATE``) a refusal. The layer's own class, emulated as it is, serves."""
    pytest.importorskip("attnhub_flash")
    from attnhub_flash.backend import backend_class
    from attnhub_vllm.mla_prefill import prefill_route

    from attnhub.mla import MLASpec

    spec = MLASpec(
        num_heads=8, kv_lora_rank=R, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, dtype=torch.bfloat16, block_size=16,
    )  # fmt: skip
    cls = backend_class("vllm-fa3")
    mla_backend = cls(spec, "cpu", emulate=True)
    route = prefill_route(mla_backend, spec, "cpu", False)  # the impl's own flag: not set
    assert route.backend is not None, route.why
    assert type(route.backend) is cls and route.backend.emulated
    assert (route.spec.head_size, route.spec.head_size_v) == (192, 128)


def test_ascend_serves_deepseeks_192_128_prefill_in_blocks_it_declares() -> None:
    """FIA in TND with keys 192 and values 128 (emulated), as vllm-ascend runs DeepSeek's
    prefill; the transient cache in a block size ascend declares (its standard layers' 128..512,
    not the latent cache's 16). Called directly (``mla_prefill``): the adapter's MLA layers
    keep the latents in vLLM's joint plane, and ascend's absorbed form reads split planes."""
    pytest.importorskip("attnhub_ascend")
    from attnhub_vllm import mla_prefill
    from vllm.model_executor.layers.attention.mla_attention import MLACommonBaseImpl

    import attnhub
    from attnhub.mla import MLASpec

    spec = MLASpec(
        num_heads=32, kv_lora_rank=R, qk_rope_head_dim=P, qk_nope_head_dim=128, v_head_dim=128,
        dtype=torch.bfloat16, block_size=16,
    )  # fmt: skip
    mla_backend = attnhub.select_backend(spec, "cpu", prefer="ascend", emulate=True)
    route = mla_prefill.prefill_route(mla_backend, spec, "cpu", True)
    assert route.backend is not None and route.backend.name == "ascend", route.why
    assert route.spec.block_size == 128 and (route.spec.head_size, route.spec.head_size_v) == (
        192,
        128,
    )
    engine = _engine("torch", "bfloat16", DEEPSEEK)  # the layer's kv_b_proj and vLLM's step
    p = _prefill(engine)
    step = mla_prefill.build_prefill_step(
        route.backend.metadata_builder(), torch.tensor(p.query_lens), "cpu"
    )
    impl = engine.impl
    kv = impl.kv_b_proj(p.kv_c)[0].view(-1, 32, 256)
    k_nope, v = kv.split([128, 128], dim=-1)
    k = MLACommonBaseImpl._concat_k_nope_k_pe(impl, k_nope, p.k_pe)
    out = torch.empty((p.q.shape[0], 32, 128), dtype=torch.bfloat16)
    mla_prefill.forward_expanded(route, p.q, k, v, step, out)
    tol = route.backend.capabilities.tolerance(torch.bfloat16)
    expanded, _ = _references(engine, p)
    torch.testing.assert_close(out.double(), expanded, atol=tol.atol, rtol=tol.rtol)


def test_the_transient_cache_is_dropped_after_the_layers_call() -> None:
    """No persistent extra KV bytes: the prefill's cache lives for one ``forward_mha`` call,
    and holds the step's prefill tokens (each request in its own blocks)."""
    from attnhub_vllm import mla_prefill

    engine = _engine("torch", "bfloat16", TINY)
    p = _prefill(engine)
    backend = engine.impl.prefill_route.backend
    made: list[Any] = []
    allocate = backend.allocate_kv_cache

    def recording(num_blocks: int) -> Any:
        cache = allocate(num_blocks)
        made.append((weakref.ref(cache.key), weakref.ref(cache.value), num_blocks))
        return cache

    backend.allocate_kv_cache = recording
    try:
        _forward_mha(engine, p)
    finally:
        del backend.allocate_kv_cache
    assert len(made) == 1
    key, value, num_blocks = made[0]
    assert key() is None and value() is None  # freed with the call
    assert num_blocks == sum(-(-n // 16) for n in p.query_lens) == 4  # 5, 17, 3 tokens
    # bytes while it lives: the prefill tokens' K and V (as vLLM's own k and v) and the
    # padding of each request's last block
    want = num_blocks * 16 * 4 * (96 + 32) * 2
    assert mla_prefill.transient_bytes(backend.spec, num_blocks) == want


# --- cached context ---------------------------------------------------------------------------

#: two decodes, then prefills: none, 16 and 41 tokens of cached context (a chunked prefill's
#: earlier chunks or a prefix-cache hit), none
CONTEXT_STEP = ([1, 1, 5, 7, 3, 9], [9, 4, 5, 23, 3, 50])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_torch_prefill_with_cached_context_matches_the_reference_and_vllms_own(dtype: str) -> None:
    """The context's latents read from vLLM's plane, expanded by ``kv_b_proj`` and attended
    with the new tokens: the whole sequence's attention (both references), and vLLM's own
    ``forward_mha`` (its context gather, its prefill backend's chunk and LSE merge)."""
    engine = _engine("torch", dtype, TINY, context=True)
    p = _prefill(engine, CONTEXT_STEP)
    assert p.md.prefill.chunked_context is not None and p.context_lens == [0, 16, 0, 41]
    got = _forward_mha(engine, p)
    _check(engine, p, got)
    vllms = _forward_mha(engine, p, vllms=True)
    tol = engine.impl.prefill_route.backend.capabilities.tolerance(p.q.dtype)
    torch.testing.assert_close(got, vllms, atol=tol.atol, rtol=tol.rtol)
    # the context counts: without it the output is another one
    no_context = _references(engine, dataclasses.replace(p, context_lens=[0] * 4))[0]
    assert not torch.allclose(got.double(), no_context, atol=tol.atol, rtol=tol.rtol)


def test_the_context_is_cut_into_calls_bounded_by_vllms_workspace() -> None:
    """Calls whose contexts sum to at most vLLM's chunked-prefill workspace (a request with more
    in a call of its own), one transient cache alive at a time; the same attention."""
    from attnhub_vllm import mla_prefill

    assert mla_prefill.plan_calls([0, 16, 0, 41], None) == [(0, 4)]
    assert mla_prefill.plan_calls([0, 16, 0, 41], 32) == [(0, 3), (3, 4)]
    assert mla_prefill.plan_calls([20, 20, 5, 0], 32) == [(0, 1), (1, 4)]
    assert mla_prefill.plan_calls([], 32) == []
    engine = _engine("torch", "float32", TINY, context=True)
    engine.builder.chunked_prefill_workspace_size = 32
    p = _prefill(engine, CONTEXT_STEP)
    step = p.md.attnhub_prefill[0]
    assert [c.tokens for c in step.chunks] == [slice(0, 15), slice(15, 24)]
    assert [c.context.batch.num_actual_tokens for c in step.chunks] == [16, 41]
    backend = engine.impl.prefill_route.backend
    made: list[int] = []
    allocate = backend.allocate_kv_cache
    backend.allocate_kv_cache = lambda n: made.append(n) or allocate(n)
    try:
        got = _forward_mha(engine, p)
    finally:
        del backend.allocate_kv_cache
    # blocks of 16: requests of 5, 7 + 16, 3 tokens; then 9 + 41
    assert made == [1 + 2 + 1, 4]
    _check(engine, p, got)


@pytest.mark.parametrize("layout", ["joint", "split"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_context_is_read_in_the_caches_layout_and_fp8_dequantized(
    layout: str, kv_cache_dtype: str
) -> None:
    """``forward_expanded`` over attnhub's latent cache in either layout (the joint plane, or
    the split planes a vendor keeps), fp8 latents read as ``fp8 * scale`` rounded to the model
    dtype (``attnhub.mla.dequantize_latent``): the reference over those latents."""
    from attnhub_vllm import mla_prefill

    from attnhub import LatentKVCache, reference
    from attnhub.mla import write_latent_kv
    from attnhub.testing import generator

    engine = _engine("torch", "bfloat16", TINY, context=True)
    p = _prefill(engine, CONTEXT_STEP)
    spec = dataclasses.replace(engine.impl.spec, kv_cache_dtype=kv_cache_dtype)
    latent = LatentKVCache.for_spec(spec, 64, layout=layout)
    g = generator(9)
    kv_c = torch.randn((64 * 16, R), generator=g).to(torch.bfloat16)
    k_pe = torch.randn((64 * 16, P), generator=g).to(torch.bfloat16)
    if latent.scale is not None:
        latent.scale.fill_(0.25)
    write_latent_kv(spec, latent, kv_c, k_pe, torch.arange(64 * 16))
    impl = engine.impl
    k, v = impl._expand(p.kv_c, p.k_pe)
    out = torch.full((p.q.shape[0], 4, 32), float("nan"), dtype=torch.bfloat16)
    step = p.md.attnhub_prefill[0]
    mla_prefill.forward_expanded(impl.prefill_route, p.q, k, v, step, out, latent, impl._expand)
    # the reference over the latents as the cache holds them (fp8: dequantized)
    want, start = [], 0
    for r, n in enumerate(p.query_lens):
        # the oracle's read (float64, fp8 times the scale), rounded to the model dtype
        ctx_c, ctx_pe = reference.read_latent_sequence(latent, p.block_table[r], p.context_lens[r])
        ctx_c, ctx_pe = ctx_c.to(torch.bfloat16), ctx_pe.to(torch.bfloat16)
        seq_c = torch.cat([ctx_c, p.kv_c[start : start + n]])
        seq_pe = torch.cat([ctx_pe, p.k_pe[start : start + n, 0]])
        o, _ = reference.mla_expanded(
            p.q[start : start + n], seq_c, seq_pe, engine.w_uk, engine.w_uv, scale=impl.scale
        )
        want.append(o)
        start += n
    tol = impl.prefill_route.backend.capabilities.tolerance(torch.bfloat16)
    torch.testing.assert_close(out.double(), torch.cat(want), atol=tol.atol, rtol=tol.rtol)


def test_flash_vllm_fa3_serves_deepseeks_prefill_with_cached_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The emulated FA3 varlen kernel at 192 / 128 over each request's context and new tokens
    (bottom-right causal), against both references."""
    _use_vllm_fa3(monkeypatch)
    engine = _engine("flash", "bfloat16", DEEPSEEK, emulate=True, context=True)
    route = engine.impl.prefill_route
    assert route.backend is not None and route.backend.name == "flash", route
    p = _prefill(engine, CONTEXT_STEP)
    _check(engine, p, _forward_mha(engine, p))


def _amx_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``cpu`` backend as on an AMX CPU (its features injected: its ``AMX_MLA`` path, vLLM's
    own ops, which run on AVX512-BF16 without AMX tiles), in a fresh registry."""
    pytest.importorskip("attnhub_cpu")
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("AMX_MLA's ops are x86 only")
    if not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("AMX_MLA's ops have no code path for this CPU (no AMX, no AVX512-BF16)")
    import attnhub_vllm.backend as adapter
    from attnhub_cpu import CpuBackend, ops
    from attnhub_cpu.backend import capabilities_for

    import attnhub
    import attnhub.registry as registry

    amx = ops.CpuFeatures("x86", avx512=True, avx512_bf16=True, amx=True)

    class AmxCpuBackend(CpuBackend):
        features = amx
        capabilities = capabilities_for(amx)

    monkeypatch.setattr(registry, "_REGISTRY", registry.Registry())
    monkeypatch.setattr(adapter, "_BACKENDS", {})
    attnhub.register_backend(AmxCpuBackend, replace=True)


def test_cpu_on_amx_mla_serves_the_prefill_with_context_in_the_absorbed_form(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``cpu`` refuses the expanded form, but its ``AMX_MLA`` path serves queries of every
    length: the prefill goes through its MLA impl over the latent cache (``extend_attention_cpu``,
    as vLLM's ``AMXMLAImpl.forward_mha``), the query absorbed by ``W_UK`` and the latent output
    projected by ``W_UV``; the same attention as both references over the whole sequence."""
    _amx_cpu(monkeypatch)
    from attnhub_vllm import mla_prefill

    from attnhub import LatentKVCache
    from attnhub.mla import write_latent_kv

    engine = _engine("cpu", "bfloat16", TINY, block=32, context=True)
    route = engine.impl.prefill_route
    assert route.backend is None and route.absorbed is not None, route
    assert route.why.startswith("attnhub (the absorbed form: the MLA impl of backend 'cpu'")
    assert "vLLM's CPU kernels take one head_dim for query, key and value" in route.why
    p = _prefill(engine, CONTEXT_STEP)
    # the new tokens' latents are in the cache before forward_mha (do_kv_cache_update)
    latent = LatentKVCache.from_joint(p.plane, R)
    slots = p.md.slot_mapping[p.md.num_decode_tokens :]
    write_latent_kv(engine.impl.spec, latent, p.kv_c, p.k_pe[:, 0], slots)
    assert not isinstance(p.md.attnhub_prefill[0], mla_prefill.PrefillStep)  # the MLA impl's
    got = _forward_mha(engine, p)
    caps = route.absorbed.capabilities
    tol = caps.mla.tolerance(torch.bfloat16, caps.tolerances)
    expanded, absorbed = _references(engine, p)
    torch.testing.assert_close(expanded, absorbed, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(got.double(), expanded, atol=tol.atol, rtol=tol.rtol)


def test_the_absorbed_prefill_is_not_taken_under_decode_context_parallel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank's latent cache holds a shard of the prefill's own tokens: vLLM's own prefill."""
    _amx_cpu(monkeypatch)
    from attnhub_vllm import mla_prefill

    import attnhub

    engine = _engine("cpu", "bfloat16", TINY, block=32)
    spec = engine.impl.spec
    mla_backend = attnhub.select_backend(spec, "cpu", prefer="cpu")
    route = mla_prefill.prefill_route(mla_backend, spec, "cpu", False, context_parallel=True)
    assert not route.attnhub and route.why.startswith("vLLM's own"), route


# --- refusals --------------------------------------------------------------------------------


def test_a_prefill_with_context_sharded_over_dcp_ranks_is_refused_naming_the_request() -> None:
    """Where such context comes to attnhub's route anyway (the engine said it would not)."""
    from attnhub_vllm import mla_prefill

    from attnhub.errors import UnsupportedConfigurationError

    engine = _engine("torch", "float32", TINY, context=True)
    p = _prefill(engine, CONTEXT_STEP)
    mla_prefill.context_refusal(p.md.prefill, 2, "torch", 1)  # one rank: served
    with pytest.raises(UnsupportedConfigurationError, match=r"MLA prefill request 1 of the step "
                       r"\(request 3 of the batch\) has 16 tokens of cached context sharded "
                       r"over 2 decode context parallel ranks"):  # fmt: skip
        mla_prefill.context_refusal(p.md.prefill, 2, "torch", 2)


@pytest.mark.parametrize(
    ("what", "match"),
    [
        ("query_width", r"query has shape \[25, 4, 576\], expected \[\*, 4, 96\]"),
        ("latents_short", "key has 24 tokens but slot_mapping has 25 entries"),
    ],
)
def test_bad_input_is_refused_with_a_typed_error(what: str, match: str) -> None:
    from attnhub.errors import InvalidInputError

    engine = _engine("torch", "float32", TINY)
    p = _prefill(engine)
    if what == "query_width":  # the absorbed query's width instead of the expanded one
        p = dataclasses.replace(p, q=torch.zeros((p.q.shape[0], 4, R + P)))
    else:  # one latent fewer than query tokens
        p = dataclasses.replace(p, kv_c=p.kv_c[:-1], k_pe=p.k_pe[:-1])
    with pytest.raises(InvalidInputError, match=match):
        _forward_mha(engine, p)
