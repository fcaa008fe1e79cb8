"""The vendor backends' own code (builders, translation, layer calls) on a stand-in accelerator.

Every test of a vendor backend runs on the CPU, where a tensor made without ``device=``, a host
read of a device tensor (``.item()``, ``.tolist()``, ``.numpy()``, ``bool()``) or a builder
that reads a batch's device tensor instead of its host copy all go unseen. Here the same step
runs twice: on the CPU through the emulator, each vendor op's arguments recorded; then on the
``meta`` device (shapes, dtypes and devices without data: a host read raises, and so does an op
mixing a host tensor with a meta one) with a batch carrying host copies, where each vendor op
is checked (every tensor argument on the device, of the CPU run's shape, dtype and strides) and
answered by the emulator from the CPU run's arguments. So the backend's own code runs on an
accelerator's terms and the emulator, which stands for the vendor's library, does not.

Checked this way on 2026-11-26 (a wider sweep: every dtype, KV-cache format, attention type and
feature each backend declares, graph capture, cascade, slot -1 rows, head_size_v, MLA): no
finding; these cases keep it so.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from attnhub import AttentionBackend, AttentionSpec, BatchMetadata, MLASpec, kit, testing
from attnhub.errors import UnsupportedConfigurationError

STAND_IN = torch.device("meta")
_PLAIN = (torch.Tensor, int, float, str, bool, type(None), tuple, list, dict)


def _tensors(x: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(x, torch.Tensor):
        return [(path, x)]
    if isinstance(x, (list, tuple)):
        return [t for i, v in enumerate(x) for t in _tensors(v, f"{path}[{i}]")]
    if isinstance(x, dict):
        return [t for k, v in x.items() for t in _tensors(v, f"{path}.{k}")]
    return []


def _map(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map(v, fn) for v in x)
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    return x


def _clone(x: Any) -> Any:
    """A copy of ``x``'s tensors that keeps which arguments were one tensor (an op may ask)."""
    memo: dict[int, torch.Tensor] = {}
    return _map(x, lambda t: memo.setdefault(id(t), t.clone()))


class OpLog:
    """The vendor op calls of the CPU run, and what the stand-in run did wrong."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, list[tuple[int, ...] | torch.dtype | Any]]] = []
        self.replay = False
        self.next = 0
        self.wrong: list[str] = []


class Ops:
    """A vendor namespace (module, op, ``.out`` overload) seen through an :class:`OpLog`."""

    def __init__(self, inner: Any, name: str, log: OpLog) -> None:
        self._inner, self._name, self._log = inner, name, log

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._inner, attr)
        return (
            value
            if isinstance(value, _PLAIN)
            else Ops(value, f"{self._name}.{attr}", log=self._log)
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        log, given = self._log, (args, kwargs)
        layout = [(tuple(t.shape), t.dtype, t.stride()) for _, t in _tensors(given)]
        if not log.replay:
            log.calls.append((self._name, _clone(given), layout))
            return self._inner(*args, **kwargs)
        name, recorded, cpu_layout = log.calls[log.next]
        log.next += 1
        assert name == self._name, f"the stand-in run called {self._name}, the CPU run {name}"
        for (path, t), mine, cpu in zip(_tensors(given), layout, cpu_layout, strict=True):
            if t.device != STAND_IN and t.dim():
                log.wrong.append(f"{self._name}{path} is on {t.device} {tuple(t.shape)}")
            if mine != cpu:
                log.wrong.append(f"{self._name}{path}: {mine} on the device, {cpu} on the CPU")
        a, k = _clone(recorded)
        result = self._inner(*a, **k)
        return _map(
            result,
            lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=STAND_IN),
        )


def _on(backend: AttentionBackend, device: torch.device, log: OpLog) -> None:
    """``backend`` (made on the CPU, emulated) moved to ``device``, its ops seen by ``log``."""
    backend.device = device
    ops: Any = backend.ops  # type: ignore[attr-defined]
    if dataclasses.is_dataclass(ops):  # flash: the provider's namespaces
        names = ("attention", "cache_ops", "mla_ops")
        seen = {n: Ops(getattr(ops, n), n, log) for n in names if getattr(ops, n) is not None}
        backend.ops = dataclasses.replace(ops, **seen)  # type: ignore[attr-defined]
    else:
        backend.ops = Ops(ops, "ops", log)  # type: ignore[attr-defined]


def _batch(spec: AttentionSpec | MLASpec, device: torch.device) -> BatchMetadata:
    """Decodes, a long context and a prefill, two padding rows and a real token with slot -1;
    on the stand-in device with its host copies."""
    bs = spec.block_size
    q, s = [1, 1, 5, 3], [9, 3 * bs + 1, 5, 40]
    batch, _ = testing.make_batch(q, s, bs, num_tokens=sum(q) + 2, seed=1)
    slots = batch.slot_mapping.clone()
    slots[1] = -1
    table = batch.block_table
    made = BatchMetadata.from_lengths(q, s, table, bs, device, num_tokens=batch.num_tokens)
    host = made.slot_mapping_cpu is not None
    return dataclasses.replace(
        made, slot_mapping=slots.to(device), slot_mapping_cpu=slots if host else None
    )


def _layer_calls(backend: AttentionBackend, batch: BatchMetadata) -> None:
    """A step's build, then forward, write_kv(meta=), forward over the cache alone, the LSE
    (where served) and a graph capture's metadata (where supported)."""
    spec, g, dev = backend.spec, testing.generator(0), backend.device
    mla = isinstance(spec, MLASpec)
    cache = backend.allocate_kv_cache(
        testing.num_blocks_for(batch.seq_lens_cpu.tolist(), spec.block_size)
    )
    for plane in (cache.key_scale, cache.value_scale) if not mla else ():
        if plane is not None and dev.type == "cpu":
            plane.fill_(0.5)
    if mla:
        q = testing.random_mla_query(spec, batch.num_tokens, g).to(dev)
        k, v = (t.to(dev) for t in testing.random_latent_kv(spec, batch.num_tokens, g))
    else:
        q, k, v = (t.to(dev) for t in testing.random_qkv(spec, batch.num_tokens, g))
    kw = (
        {"sinks": testing.random_sinks(spec.num_heads, g).to(dev)}
        if not mla and spec.use_sinks
        else {}
    )
    impl, builder = backend.impl(**kw), backend.metadata_builder()
    if backend.name == "iluvatar" and getattr(cache, "value_scale", None) is not None:
        # iluvatar's int8: the static value scale's values are read on the host once per change
        # of the tensor (an engine sets it with the weights), by design; taken as read here
        impl._checked_value_scales.add(kit.tensor_state(cache.value_scale))
    meta = builder.build(batch)
    impl.forward(q, k, v, cache, meta)
    impl.write_kv(k, v, cache, meta=meta)
    impl.forward(q, None, None, cache, meta)
    with contextlib.suppress(UnsupportedConfigurationError):  # where the LSE is not served
        impl.forward(q, k, v, cache, meta, return_lse=True)
    if builder.graph_support:
        table = batch.host_block_table()[:2]
        decodes = BatchMetadata.from_lengths([1, 1], [9, 30], table, spec.block_size, dev)
        impl.forward(q[:2], k[:2], v[:2], cache, builder.build_for_graph_capture(decodes))


def _backends() -> list[Any]:
    from attnhub_ascend import AscendBackend
    from attnhub_flash.backend import BACKENDS as FLASH
    from attnhub_iluvatar import IluvatarBackend

    class AscendATB(AscendBackend):  # the 310P write (_npu_reshape_and_cache)
        kv_write_op = "_npu_reshape_and_cache"

    def spec(hs: int, bs: int, **kw: Any) -> AttentionSpec:
        return AttentionSpec(
            num_heads=4, num_kv_heads=2, head_size=hs, dtype=torch.bfloat16, block_size=bs, **kw
        )

    mla = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    return [
        pytest.param(AscendBackend, spec(128, 128), id="ascend"),
        pytest.param(AscendBackend, spec(128, 128, use_sinks=True), id="ascend-sinks"),
        pytest.param(AscendBackend, spec(128, 128, sliding_window=300), id="ascend-window"),
        pytest.param(AscendATB, spec(128, 128), id="ascend-atb-write"),
        pytest.param(
            AscendBackend,
            MLASpec(num_heads=32, dtype=torch.bfloat16, block_size=128, **mla),
            id="ascend-mla",
        ),
        pytest.param(IluvatarBackend, spec(128, 16), id="iluvatar"),
        pytest.param(IluvatarBackend, spec(128, 16, kv_cache_dtype="int8"), id="iluvatar-int8"),
        pytest.param(FLASH["vllm"], spec(128, 16, logits_soft_cap=30.0), id="flash-vllm-softcap"),
        pytest.param(
            FLASH["vllm-fa3"], spec(128, 16, kv_cache_dtype="fp8_e4m3"), id="flash-vllm-fa3-fp8"
        ),
        pytest.param(FLASH["fa4"], spec(128, 16), id="flash-fa4"),
        pytest.param(
            FLASH["fa3"],
            MLASpec(num_heads=16, dtype=torch.bfloat16, block_size=16, **mla),
            id="flash-fa3-mla",
        ),
    ]


@pytest.mark.parametrize(("backend_type", "spec"), _backends())
def test_a_vendor_backend_on_an_accelerator_reads_no_device_value_and_gives_its_ops_device_tensors(
    backend_type: type[AttentionBackend], spec: AttentionSpec | MLASpec
) -> None:
    log = OpLog()
    for device in (torch.device("cpu"), STAND_IN):  # the CPU run records each op's arguments
        log.replay = device == STAND_IN
        backend = backend_type(spec, "cpu", emulate=True)
        _on(backend, device, log)
        _layer_calls(backend, _batch(spec, device))
    assert log.calls and log.next == len(log.calls), (log.next, len(log.calls))
    assert not log.wrong, "\n".join(log.wrong)
