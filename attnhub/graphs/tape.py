"""A CPU stand-in for a device graph: the ops a step launches, recorded once and replayed.

A device graph (``torch.cuda.CUDAGraph``, ``torch.npu.NPUGraph``) records the *kernels* a step
launches, each with its arguments as they were at capture: tensor arguments are addresses (what
the tensor holds is read at replay), every host-side value (a Python int, a list of lengths, a
shape) is baked in. Python does not run again on replay.

:class:`Tape` does the same on any device, at PyTorch's dispatcher level: under a
``TorchDispatchMode`` every aten op the step launches is executed and recorded, tensors by
reference and everything else by value (copied). :meth:`Tape.replay` re-executes the recorded
ops in order, writing each op's results into the tensors the capture produced, so later ops
(which hold references to those) read the new values. Whatever the step's Python code computed
on the host at capture stays what it was, exactly as on a device: replaying a tape tells the
truth about what a captured graph would compute.

Capture refuses what a device capture refuses: a host read of a tensor's value (``.item()``,
``bool(t)``, ``.tolist()``: aten ``_local_scalar_dense``) and ops whose output size depends on
the data (``nonzero``, boolean-mask indexing, ``unique``, ...), with :class:`GraphCaptureError`.

An *opaque call* (:meth:`Tape.call`) is one recorded entry for a whole Python function (a
vendor emulator's fused op), with its host arguments copied at the call; the aten ops it runs
inside are not recorded separately. Entries can be replaced (:meth:`Tape.replace`): that is how
an emulated task-group update swaps a kernel's host arguments. :func:`kernel_call` is how a
vendor emulator's op becomes one: while a tape records (the eager adaptor's capture), the op is
recorded as one opaque entry, as a device graph records one kernel launch: its tensors read at
replay, its host arguments (``max_seqlen_k``, ``num_splits``, ...) as they were at capture.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attnhub.graphs.errors import GraphCaptureError

#: aten ops a device graph cannot capture: a host read of a value, or an output whose size
#: depends on the data (capturing them syncs with the host, which a capture refuses).
UNCAPTURABLE = {
    "_local_scalar_dense": "a host read of a tensor's value (.item(), bool(), int(), .tolist())",
    "nonzero": "nonzero() (its output size depends on the data)",
    "nonzero_static": None,  # static output size: capturable
    "masked_select": "masked_select (its output size depends on the data)",
    "unique": "unique (its output size depends on the data)",
    "_unique": "unique (its output size depends on the data)",
    "_unique2": "unique (its output size depends on the data)",
    "unique_consecutive": "unique_consecutive (its output size depends on the data)",
    "unique_dim": "unique (its output size depends on the data)",
    "equal": "torch.equal (returns a host bool)",
    "is_nonzero": "a host read of a tensor's value (bool())",
}
_REPEATS = "repeat_interleave with tensor repeats and no output_size"
_DATA_SIZED_OVERLOADS = {
    ("repeat_interleave", "Tensor"): _REPEATS,
    ("repeat_interleave", "self_Tensor"): _REPEATS,
}


def _freeze(x: Any) -> Any:
    """Host values by value, tensors by reference (as a device graph bakes kernel args)."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, list):
        return [_freeze(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_freeze(v) for v in x)
    if isinstance(x, dict):
        return {k: _freeze(v) for k, v in x.items()}
    if x is None or isinstance(
        x, (int, float, bool, str, complex, torch.dtype, torch.device, torch.layout)
    ):
        return x
    if callable(x) or isinstance(x, torch.ScriptObject):  # ops, functions, and C++ handles
        return x  # (a process group, a reduce op): recorded as themselves
    return copy.deepcopy(x)


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _has_mask(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
        for i in (indices or ())
    )


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


@dataclass
class TapeEntry:
    """One recorded op: what to call, its frozen arguments, the tensors it produced."""

    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[torch.Tensor]

    def run(self) -> None:
        # copies of the frozen containers: an op may not mutate what the tape holds
        result = self.fn(*_freeze(self.args), **_freeze(self.kwargs))
        new = _tensors(result)
        if len(new) != len(self.outputs):
            raise GraphCaptureError(
                f"replaying {self.name}: it produced {len(new)} tensors, {len(self.outputs)} at "
                "capture"
            )
        for captured, fresh in zip(self.outputs, new, strict=True):
            if fresh is captured or _same_view(fresh, captured):
                continue  # an in-place op or a view: the memory is already the captured one
            if fresh.shape != captured.shape:
                raise GraphCaptureError(
                    f"replaying {self.name}: output shape {list(fresh.shape)}, "
                    f"{list(captured.shape)} at capture (a data-dependent shape)"
                )
            captured.copy_(fresh)


class CollectiveEntry(TapeEntry):
    """A recorded collective (a ``c10d`` op: ``all_gather``, ``reduce_scatter``,
    ``all_to_all``...) of a ``torch.distributed`` group, run again by every replay and waited
    for there (its ``Work``), as the collective a device graph captures runs on the stream of
    each replay. Every rank of the group must replay its graphs in the same order (as it
    captured them), or the ranks' collectives do not match. Whether a group's collectives may
    sit in a graph at all is the caller's to check: NCCL's and HCCL's can be captured on their
    devices, gloo's only on this tape (docs/context-parallel.md, "Graphs")."""

    def run(self) -> None:
        result = self.fn(*_freeze(self.args), **_freeze(self.kwargs))
        for work in _works(result):
            work.wait()


def _works(x: Any) -> list[Any]:
    if isinstance(x, torch.ScriptObject) and hasattr(x, "wait"):
        return [x]
    if isinstance(x, (list, tuple)):
        return [w for v in x for w in _works(v)]
    return []


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: Tape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.tape._paused:
            return func(*args, **kwargs)
        packet = func.overloadpacket.__name__
        why = UNCAPTURABLE.get(packet) or _DATA_SIZED_OVERLOADS.get((packet, func._overloadname))
        if packet == "repeat_interleave" and kwargs.get("output_size") is not None:
            why = None
        if packet in ("index", "index_put", "_index_put_impl") and _has_mask(args):
            why = "indexing with a boolean mask (its size depends on the data: nonzero)"
        if why is not None:
            raise GraphCaptureError(f"cannot capture aten.{packet}: {why}")
        frozen_args, frozen_kwargs = _freeze(args), _freeze(kwargs)
        result = func(*args, **kwargs)
        kind = CollectiveEntry if func.namespace == "c10d" else TapeEntry
        self.tape.entries.append(
            kind(str(func), func, frozen_args, frozen_kwargs, _tensors(result))
        )
        return result


#: The tapes recording now, innermost last (a capture inside a capture is refused).
_RECORDING: list[Tape] = []


def recording_tape() -> Tape | None:
    """The tape recording now (None outside a capture, or while its recording is paused)."""
    if not _RECORDING or _RECORDING[-1]._paused:
        return None
    return _RECORDING[-1]


def kernel_call(name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict) -> Any:
    """Run a vendor emulator's op ``fn(*args, **kwargs)``: inside a capture on the eager tape,
    as one opaque tape entry (its host arguments frozen now, its tensors read at every replay:
    a device kernel's launch); else directly. An ``attnhub.emulation.OpLog.op`` route."""
    tape = recording_tape()
    if tape is None:
        return fn(*args, **kwargs)
    return tape.call(name, fn, args, kwargs)[1]


class Tape:
    """The ops of one captured step (see the module docstring)."""

    def __init__(self) -> None:
        self.entries: list[TapeEntry] = []
        self._mode: _Recorder | None = None
        self._paused = False

    @contextmanager
    def recording(self) -> Iterator[Tape]:
        """Record (and run) every aten op launched in the block."""
        if self._mode is not None:
            raise GraphCaptureError("this tape is already recording")
        self._mode = _Recorder(self)
        _RECORDING.append(self)
        try:
            with self._mode:
                yield self
        finally:
            _RECORDING.remove(self)
            self._mode = None

    def call(
        self, name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[int, Any]:
        """Record ``fn(*args, **kwargs)`` as one entry (host values copied now), run it with
        recording paused, and return (the entry's index, its result)."""
        entry = TapeEntry(name, fn, _freeze(args), _freeze(kwargs), [])
        with self.paused():
            result = fn(*args, **kwargs)
        entry.outputs = _tensors(result)
        self.entries.append(entry)
        return len(self.entries) - 1, result

    def replace(
        self, index: int, name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict
    ) -> None:
        """Swap entry ``index`` for a call of the same op with new arguments (its outputs stay
        the captured tensors)."""
        old = self.entries[index]
        self.entries[index] = TapeEntry(name, fn, _freeze(args), _freeze(kwargs), old.outputs)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing launched in the block is recorded (an opaque call's insides)."""
        was, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = was

    def replay(self) -> None:
        """Re-execute every recorded op, in order (the tape must not be recording)."""
        if self._mode is not None:
            raise GraphCaptureError("replay during capture")
        for entry in self.entries:
            entry.run()

    def __len__(self) -> int:
        return len(self.entries)
