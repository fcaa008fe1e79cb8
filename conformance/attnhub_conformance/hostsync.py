"""Detecting device-to-host syncs on a CPU: tensors that refuse to be read on the host.

A backend that declares graph capture may not read device data on the host in ``forward``
(``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``, ``t.cpu()``, ``nonzero()``...): on an
accelerator each is a sync, and a captured graph would bake the value in. On a CPU nothing
syncs, so the suite wraps every device-side tensor forward receives (the built metadata's, the
inputs', the cache's) in :class:`HostSyncGuard`, a tensor subclass that raises
:class:`HostSyncError` on those calls. Results of ops on guarded tensors are guarded too, so a
sync through a derived value (``bool((slots >= 0).all())``) is caught as well.

Metadata fields whose name ends in ``_cpu`` are host copies by convention (BatchMetadata's
``query_start_loc_cpu``, ``seq_lens_cpu``) and are left alone; plain Python values are host data
by nature.

A vendor backend's CPU emulator stands in for the device: what its ops read happens on the
device, not in the backend's host code. A module that is such device code says so with a
module-level ``__attnhub_device_code__ = True``; reads made from inside it are allowed.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import traceback
from typing import Any, ClassVar, TypeVar

import torch

from attnhub import PagedKVCache


class HostSyncError(AssertionError):
    """forward read a device tensor on the host."""


_FORBIDDEN = {
    "item": ".item()",
    "tolist": ".tolist()",
    "__bool__": "bool()",
    "cpu": ".cpu()",
    "__index__": "__index__ (used as a Python int or index)",
    "__int__": "int()",
    "__float__": "float()",
    "numpy": ".numpy()",
    "nonzero": "nonzero() (its output size depends on the data)",
    "__array__": "numpy conversion",
}


def _to_host(args: tuple[object, ...], kwargs: dict[str, object]) -> bool:
    """Whether a ``Tensor.to(...)`` call names the host (the CPU) as its device."""
    for a in (*args, kwargs.get("device")):
        if isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu":
            return True
    return False


def _in_device_code() -> bool:
    """Whether the call comes from a module marked ``__attnhub_device_code__`` (an emulator)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__attnhub_device_code__") is True:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class HostSyncGuard(torch.Tensor):
    """A tensor that raises HostSyncError when read on the host. See the module docstring."""

    origin: ClassVar[str] = "a tensor computed from forward's device-side inputs"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        forbidden = _FORBIDDEN.get(name)
        if forbidden is None and name == "to" and _to_host(args[1:], kwargs):
            forbidden = '.to("cpu") (a copy to the host)'
        if forbidden is not None and not _in_device_code():
            what = next((a for a in args if isinstance(a, HostSyncGuard)), None)
            origin = getattr(what, "_attnhub_origin", cls.origin)
            raise HostSyncError(
                f"forward called {forbidden} on {origin}: a device-to-host sync, which a "
                "backend must not do per layer"
            )
        return super().__torch_function__(func, types, args, kwargs)

    def __bool__(self) -> bool:  # also reached without __torch_function__ on some paths
        if _in_device_code():
            return bool(self.as_subclass(torch.Tensor))
        raise HostSyncError(
            f"forward called bool() on {getattr(self, '_attnhub_origin', self.origin)}: a "
            "device-to-host sync, which a backend must not do per layer"
        )


def where(exc: BaseException) -> str:
    """The innermost frame of the backend that made the host read (outside torch and here)."""
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if f.filename != __file__ and "/torch/" not in f.filename
    ]
    if not frames:
        return "an unknown place"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {f.line}"


def guard(t: torch.Tensor, origin: str) -> torch.Tensor:
    g = t.as_subclass(HostSyncGuard)
    g._attnhub_origin = origin  # type: ignore[attr-defined]
    return g


def unguard(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor) if isinstance(t, HostSyncGuard) else t


T = TypeVar("T")


def guard_tree(obj: T, path: str) -> T:
    """A copy of ``obj`` (metadata) with every device-side tensor guarded. Recurses through
    dataclasses, lists, tuples and dicts; leaves ``*_cpu`` fields and everything else alone."""
    if isinstance(obj, torch.Tensor):
        return guard(obj, f"metadata field {path}")  # type: ignore[return-value]
    if isinstance(obj, list):
        return [guard_tree(x, f"{path}[{i}]") for i, x in enumerate(obj)]  # type: ignore[return-value]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(guard_tree(x, f"{path}[{i}]") for i, x in enumerate(obj))  # type: ignore[return-value]
    if isinstance(obj, dict):
        return {k: guard_tree(v, f"{path}[{k!r}]") for k, v in obj.items()}  # type: ignore[return-value]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new: Any = copy.copy(obj)
        for f in dataclasses.fields(obj):
            if f.name.endswith("_cpu") or not hasattr(obj, f.name):
                continue
            value = getattr(obj, f.name)
            guarded = guard_tree(value, f"{path}.{f.name}")
            if guarded is not value:
                object.__setattr__(new, f.name, guarded)
        return new
    return obj


def guard_cache(cache: PagedKVCache) -> PagedKVCache:
    """The same cache (shared storage) with guarded planes."""

    def g(t: torch.Tensor | None, name: str) -> torch.Tensor | None:
        return None if t is None else guard(t, f"the KV cache's {name}")

    return dataclasses.replace(
        cache,
        key=guard(cache.key, "the KV cache's key"),
        value=guard(cache.value, "the KV cache's value"),
        key_scale=g(cache.key_scale, "key_scale"),
        value_scale=g(cache.value_scale, "value_scale"),
    )


def run_layer_guarded(
    impl: Any,  # an AttentionImpl
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    cache: PagedKVCache,
    meta: Any,  # the step's AttentionMetadata
) -> torch.Tensor:
    """One layer of a step as an engine that separates the KV write runs it, with every
    device-side input guarded: ``write_kv(meta=)`` (when there are new keys), then ``forward``.
    Returns forward's output, unguarded; a host read raises HostSyncError."""
    guarded_meta = guard_tree(meta, "meta")
    k = None if key is None else guard(key, "the key input")
    v = None if value is None else guard(value, "the value input")
    if k is not None and v is not None:
        impl.write_kv(k, v, guard_cache(cache), meta=guarded_meta)
    out = impl.forward(guard(query, "the query input"), k, v, guard_cache(cache), guarded_meta)
    return unguard(out)
