"""A CPU emulation of the ``torch.npu`` graph API the ascend backend and attnhub's
``NPUGraphAdaptor`` call: graphs, task groups and their updates, streams and events.

``ops.graph_namespace`` hands this module out where ``torch.npu`` would be (``torch_npu``
patches the graph API into ``torch.npu``). Signatures follow ``torch_npu/npu/graphs.py`` and
``torch_npu/npu/streams.py`` / ``utils.py`` of the wheel (Python code, not the op YAML; checked
by ``tests/test_ascend_contract.py``); behaviour follows those sources and vllm-ascend's callers
(``ACLGraphWrapper``, ``attention_v1.py``) [callers]:

- ``NPUGraph`` / ``graph(g, pool=None, stream=None, ...)``: capture records, on its own capture
  stream, everything the step launches: every aten op (attnhub's tape: tensors by reference,
  host values by value) and every emulated ``torch_npu`` op as one task with its host
  arguments copied at the call. ``replay()`` re-executes the recording; Python does not run.
  Capture on the default stream is refused, as on the device.
- ``graph_task_group_begin(stream)`` / ``graph_task_group_end(stream) -> handle``: the ops
  between them, on the capturing stream, form a task group.
- ``graph_task_update_begin(stream, handle)`` ... ``graph_task_update_end(stream)``: outside
  capture, on ``stream`` made current (``torch.npu.stream(stream)``), the op calls in between
  are not run: they replace the group's tasks (same ops, same count), new host values and all.
- ``ExternalEvent``: ``wait`` before ``record`` is allowed; captured ``wait``/``reset`` run at
  replay: a replay whose event nothing recorded since the last reset would wait forever on
  the device, and raises :class:`NpuGraphError` here (the update was skipped).
- ordering: the device runs work asynchronously; this CPU runs it at once, so a race cannot
  happen here, but it can be *detected*: a task update of a graph whose last replay ran on
  another stream, with no event ordering the update stream after that replay and no host
  synchronization since, would race that replay on the device (its outcome is undefined
  there) and raises :class:`NpuGraphError` here [inferred: emulating undefined behaviour as an
  error]. ``host_syncs`` counts ``synchronize`` calls (device, stream, event).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar

from attnhub.kit import Tape, TapeEntry
from attnhub_ascend import emulator
from attnhub_ascend.emulator import NotEmulatedError, NpuOpError

#: The emulated runtime is the device: host reads made here are device-side (hostsync guard).
__attnhub_device_code__ = True

__all__ = [
    "Event",
    "ExternalEvent",
    "NPUGraph",
    "NpuGraphError",
    "Stream",
    "current_stream",
    "graph",
    "graph_pool_handle",
    "graph_task_group_begin",
    "graph_task_group_end",
    "graph_task_update_begin",
    "graph_task_update_end",
    "host_syncs",
    "is_current_stream_capturing",
    "stream",
    "synchronize",
]


class NpuGraphError(NpuOpError):
    """A graph-API call the device refuses, or one whose outcome the device leaves undefined."""


#: "synchronize" / "Stream.synchronize" / "Event.synchronize" -> calls (host waits for device).
host_syncs: Counter[str] = Counter()
_ids = itertools.count(1)


# --- streams and events -------------------------------------------------------------------------


class Stream:
    """An NPU stream. ``clock`` counts the graph replays launched on it; ``seen`` holds, per
    other stream, the latest replay of it this stream is ordered after (through events)."""

    _all: ClassVar[list[Stream]] = []

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = device
        self.priority = priority
        self.id = next(_ids)
        self.clock = 0
        self.seen: dict[int, int] = {}
        Stream._all.append(self)

    def wait_event(self, event: Event) -> None:
        event.wait(self)

    def wait_stream(self, stream: Stream) -> None:
        self._after(stream.id, stream.clock)

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        host_syncs["Stream.synchronize"] += 1
        _refuse_behind_blocked(self, "Stream.synchronize")
        _host_seen[self.id] = self.clock

    def query(self) -> bool:
        return True  # work runs at once here

    def _after(self, stream_id: int, clock: int) -> None:
        if stream_id != self.id:
            self.seen[stream_id] = max(self.seen.get(stream_id, 0), clock)

    def ordered_after(self, stream: Stream, clock: int) -> bool:
        """Whether work launched now on this stream runs after ``stream``'s work up to
        ``clock`` (same stream, an event, or a host synchronization since)."""
        return (
            stream is self
            or self.seen.get(stream.id, 0) >= clock
            or _host_seen.get(stream.id, 0) >= clock
        )

    def __repr__(self) -> str:
        return f"<emulated torch.npu.Stream {self.id}>"


_host_seen: dict[int, int] = {}  # stream id -> clock the host has waited for
_default_stream = Stream()
_current: list[Stream] = [_default_stream]


def current_stream(device: Any = None) -> Stream:
    return _current[-1]


class StreamContext:
    def __init__(self, stream: Stream | None) -> None:
        self.stream = stream

    def __enter__(self) -> Stream | None:
        if self.stream is not None:
            _current.append(self.stream)
        return self.stream

    def __exit__(self, *exc: object) -> None:
        if self.stream is not None:
            _current.pop()


def stream(stream: Stream | None) -> StreamContext:
    """``with torch.npu.stream(s):``: work launched in the block goes to ``s``."""
    return StreamContext(stream)


def synchronize(device: Any = None) -> None:
    """The host waits for every stream (what the seed does before every replay)."""
    host_syncs["synchronize"] += 1
    _refuse_behind_blocked(None, "synchronize")
    for s in Stream._all:
        _host_seen[s.id] = s.clock


class Event:
    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self._at: tuple[int, int] | None = None  # (stream id, its clock when recorded)

    def record(self, stream: Stream | None = None) -> None:
        stream = stream if stream is not None else current_stream()
        _refuse_in_capture(stream, "Event.record")
        _refuse_behind_blocked(stream, "Event.record")
        self._at = (stream.id, stream.clock)

    def wait(self, stream: Stream | None = None) -> None:
        stream = stream if stream is not None else current_stream()
        _refuse_in_capture(stream, "Event.wait")
        if self._at is not None:
            stream._after(*self._at)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        host_syncs["Event.synchronize"] += 1
        if self._at is not None:
            _host_seen[self._at[0]] = max(_host_seen.get(self._at[0], 0), self._at[1])


class ExternalEvent:
    """An event with ``graph_external=True``: ``wait`` may come before ``record``; reset it
    before reuse. Captured ``wait``/``reset`` become nodes of the graph."""

    def __init__(self) -> None:
        self.recorded = False
        self.id = next(_ids)

    def record(self, stream: Stream | None = None) -> None:
        stream = stream if stream is not None else current_stream()
        _refuse_in_capture(stream, "ExternalEvent.record")
        self.recorded = True
        blocked = _blocked
        if blocked is not None and blocked.event is self:  # the blocked replay goes on
            _run(blocked, blocked.at)

    def wait(self, stream: Stream | None = None) -> None:
        stream = stream if stream is not None else current_stream()
        if not _node(stream, f"ExternalEvent {self.id}.wait", self._wait):
            self._wait()

    def reset(self, stream: Stream | None = None) -> None:
        stream = stream if stream is not None else current_stream()
        if not _node(stream, f"ExternalEvent {self.id}.reset", self._reset):
            self._reset()

    def _wait(self) -> None:
        if not self.recorded:
            raise NpuGraphError(
                f"a wait on ExternalEvent {self.id}, which nothing recorded since its last reset: "
                "on the device the stream would wait forever (was the graph's task update "
                "skipped?)"
            )
        self.recorded = False  # "该接口会自动复位Event": a wait resets the event itself [doc]

    def _reset(self) -> None:
        self.recorded = False


# --- graphs -------------------------------------------------------------------------------------


class _Capture:
    def __init__(self, graph: NPUGraph, stream: Stream) -> None:
        self.graph = graph
        self.stream = stream
        self.group_start: int | None = None


_capture: _Capture | None = None


class _TaskGroupHandle:
    """What ``graph_task_group_end`` returns (``torch_npu._C._NPUTaskGroupHandle``)."""

    def __init__(self, graph: NPUGraph, start: int, end: int, ops: tuple[str, ...]) -> None:
        self.graph, self.start, self.end, self.ops = graph, start, end, ops


class _Update:
    def __init__(self, handle: _TaskGroupHandle, stream: Stream) -> None:
        self.handle = handle
        self.stream = stream
        self.calls: list[tuple[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []


_update: _Update | None = None


def graph_pool_handle() -> object:
    return object()


def is_current_stream_capturing() -> bool:
    return _capture is not None and _capture.stream is current_stream()


class NPUGraph:
    def __init__(self) -> None:
        self.tape: Tape | None = None
        self.capture_stream: Stream | None = None
        self._recording: Any = None
        self.last_replay: tuple[Stream, int] | None = None
        self.replays = 0

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        global _capture
        if _capture is not None:
            raise NpuGraphError("a capture is already underway (one at a time per process)")
        if self.tape is not None:
            raise NpuGraphError("this NPUGraph holds a capture already (reset() it first)")
        s = current_stream()
        if s is _default_stream:
            raise NpuGraphError("capture on the default stream is not allowed")
        _refuse_behind_blocked(None, "a capture")
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise NpuGraphError(
                f"capture_error_mode {capture_error_mode!r} is not one of "
                "'global', 'thread_local', 'relaxed'"
            )
        self.tape = Tape()
        self.capture_stream = s
        self._recording = self.tape.recording()
        self._recording.__enter__()
        _capture = _Capture(self, s)

    def capture_end(self) -> None:
        global _capture
        if _capture is None or _capture.graph is not self:
            raise NpuGraphError("capture_end without this graph's capture_begin")
        open_group = _capture.group_start is not None
        _capture = None
        self._recording.__exit__(None, None, None)
        self._recording = None
        if open_group:
            raise NpuGraphError("capture ended inside a task group (no graph_task_group_end)")

    def replay(self) -> None:
        if self.tape is None or self._recording is not None:
            raise NpuGraphError("replay of a graph that was not captured")
        if _capture is not None:
            raise NpuGraphError("replay during a capture")
        s = current_stream()
        _refuse_behind_blocked(s, "a replay")
        before = self.last_replay
        s.clock += 1
        self.last_replay = (s, s.clock)
        self.replays += 1
        _run(_Replay(self, s, before), 0)

    def reset(self) -> None:
        self.tape = None

    def pool(self) -> object:
        return object()


class graph:
    """``with torch.npu.graph(g, pool=..., stream=...)``: capture on ``stream`` (default: the
    class's own side stream). Entering synchronizes the device, as torch_npu's does."""

    default_capture_stream: Stream | None = None

    def __init__(
        self,
        npu_graph: NPUGraph,
        pool: Any = None,
        stream: Stream | None = None,
        auto_dispatch_capture: bool = False,
        capture_error_mode: str = "global",
    ) -> None:
        if auto_dispatch_capture:
            raise NotEmulatedError("graph(auto_dispatch_capture=True) is not emulated")
        if graph.default_capture_stream is None:
            graph.default_capture_stream = Stream()
        self.pool = pool
        self.capture_stream = stream if stream is not None else graph.default_capture_stream
        self.npu_graph = npu_graph
        self.capture_error_mode = capture_error_mode

    def __enter__(self) -> None:
        synchronize()
        _current.append(self.capture_stream)
        try:
            self.npu_graph.capture_begin(self.pool, capture_error_mode=self.capture_error_mode)
        except BaseException:
            _current.pop()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self.npu_graph.capture_end()
        finally:
            _current.pop()


class _Replay:
    """A replay on the device: it runs its tasks in order and stops at a captured wait on an
    ExternalEvent nothing has recorded (the stream blocks there), going on when it is."""

    def __init__(self, graph: NPUGraph, stream: Stream, before: tuple[Stream, int] | None):
        self.graph, self.stream, self.before = graph, stream, before
        self.at = 0  # the next entry to run
        self.event: ExternalEvent | None = None  # what it is blocked on


#: The replay blocked on an ExternalEvent, if any (one at a time: anything else launched behind
#: it would wait too, see _refuse_behind_blocked).
_blocked: _Replay | None = None


def _run(replay: _Replay, start: int) -> None:
    """Run ``replay``'s entries from ``start`` until the end or a wait nothing recorded."""
    global _blocked
    tape = replay.graph.tape
    assert tape is not None
    entries = tape.entries
    for i in range(start, len(entries)):
        entry = entries[i]
        event = getattr(entry.fn, "__self__", None)
        if isinstance(event, ExternalEvent) and entry.fn.__name__ == "_wait" and not event.recorded:
            replay.at, replay.event = i, event
            _blocked = replay
            return
        if _update is not None and _update.handle.graph is replay.graph:
            h = _update.handle
            if h.start <= i < h.end:
                raise NpuGraphError(
                    "a replay ran a task while its update was still open (its ExternalEvent was "
                    "recorded before graph_task_update_end): on the device it could run the "
                    "half-updated task"
                )
        entry.run()
    replay.at, replay.event = len(entries), None
    if _blocked is replay:
        _blocked = None


def _refuse_behind_blocked(stream: Stream | None, what: str) -> None:
    """Work that would wait behind a blocked replay: the emulator runs work at once and cannot
    queue it, so it raises where the device would wait (for ever, unless a record comes). The
    blocked replay is then dropped (reported once), so that the process can go on."""
    global _blocked
    blocked = _blocked
    if blocked is None or (stream is not None and stream is not blocked.stream):
        return
    assert blocked.event is not None
    _blocked = None
    raise NpuGraphError(
        f"{what} behind a replay that waits on ExternalEvent {blocked.event.id}, which nothing "
        "recorded since its last reset: on the device it would wait forever (was the graph's "
        "task update skipped?)"
    )


def graph_task_group_begin(stream: Stream) -> None:
    cap = _capturing_on(stream, "graph_task_group_begin")
    if cap.group_start is not None:
        raise NpuGraphError("graph_task_group_begin inside an open task group")
    assert cap.graph.tape is not None
    cap.group_start = len(cap.graph.tape)


def graph_task_group_end(stream: Stream) -> _TaskGroupHandle:
    cap = _capturing_on(stream, "graph_task_group_end")
    if cap.group_start is None:
        raise NpuGraphError("graph_task_group_end without graph_task_group_begin")
    tape = cap.graph.tape
    assert tape is not None
    start, end = cap.group_start, len(tape)
    cap.group_start = None
    entries = tape.entries[start:end]
    if not entries or any(e.name.removesuffix(".out") not in emulator.OPS for e in entries):
        raise NotEmulatedError(
            "a task group of anything but torch_npu op calls (aten ops, events) is not "
            f"emulated; got {[e.name for e in entries]}"
        )
    return _TaskGroupHandle(cap.graph, start, end, tuple(e.name for e in entries))


def graph_task_update_begin(stream: Stream, handle: _TaskGroupHandle) -> None:
    global _update
    if _capture is not None:
        raise NpuGraphError("graph_task_update_begin during a capture")
    if _update is not None:
        raise NpuGraphError("graph_task_update_begin inside an open update")
    if not isinstance(handle, _TaskGroupHandle):
        raise NpuGraphError(f"handle must come from graph_task_group_end, got {handle!r}")
    if current_stream() is not stream:
        raise NpuGraphError(
            "graph_task_update_begin(stream, ...) with another stream current: the updated "
            "op would be launched elsewhere (use `with torch.npu.stream(stream):`)"
        )
    if stream is handle.graph.capture_stream:
        raise NpuGraphError(
            "graph_task_update_begin on the graph's capture stream: the update stream must "
            'differ from it ("图更新阶段的流同图捕获阶段的流必须不同") [doc]'
        )
    last = handle.graph.last_replay
    blocked = _blocked
    if blocked is not None and blocked.graph is handle.graph:
        if handle.start < blocked.at:
            raise NpuGraphError(
                "a task update of a task the replay in flight has already passed (it is "
                "blocked on a later ExternalEvent): on the device the update could rewrite the "
                "task while that replay runs it"
            )
        # the task runs after the blocked wait, which a record after this update releases
        # (vllm-ascend's order: replay, then update and record); the update must still come
        # after the replay before it
        last = blocked.before
    if last is not None and not stream.ordered_after(*last):
        replayed_on = last[0]
        raise NpuGraphError(
            f"a task update on {stream!r} of a graph last replayed on {replayed_on!r} with "
            "nothing ordering the update after that replay (no event waited on, no "
            "synchronize): on the device the update could rewrite the task before the "
            "replay ran it"
        )
    _update = _Update(handle, stream)


def graph_task_update_end(stream: Stream) -> None:
    global _update
    upd = _update
    if upd is None or upd.stream is not stream:
        raise NpuGraphError("graph_task_update_end without graph_task_update_begin on this stream")
    _update = None
    h = upd.handle
    names = tuple(name for name, *_ in upd.calls)
    if names != h.ops:
        raise NpuGraphError(
            f"a task update must launch the group's ops again, {list(h.ops)}; got {list(names)}"
        )
    tape = h.graph.tape
    assert tape is not None
    for i, (name, fn, args, kwargs) in enumerate(upd.calls):
        tape.replace(h.start + i, name, fn, args, kwargs)


def _capturing_on(stream: Stream, what: str) -> _Capture:
    if _capture is None or _capture.stream is not stream:
        raise NpuGraphError(f"{what}({stream!r}) outside a capture on that stream")
    return _capture


def _refuse_in_capture(stream: Stream, what: str) -> None:
    if _capture is not None and _capture.stream is stream:
        raise NotEmulatedError(f"{what} inside a capture is not emulated")


def _node(stream: Stream, name: str, fn: Callable[[], None]) -> bool:
    """Append ``fn`` to the capturing graph as a node run at replay (not now); False when
    ``stream`` is not capturing."""
    if _capture is None or _capture.stream is not stream:
        return False
    tape = _capture.graph.tape
    assert tape is not None
    tape.entries.append(TapeEntry(name, fn, (), {}, []))
    return True


def _dispatch(
    name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Every emulated torch_npu op call: replaces a task in an update, is recorded as a task
    in a capture, else runs."""
    if name.endswith("_get_max_workspace"):
        # a host-side size query and an allocation: no task, nothing the graph holds
        if _capture is not None:
            assert _capture.graph.tape is not None
            with _capture.graph.tape.paused():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    if _update is not None and current_stream() is _update.stream:
        fn, kwargs = _task_workspace(name, fn, kwargs, updating=True)
        _update.calls.append((name, fn, args, dict(kwargs)))
        return None
    if _capture is not None and current_stream() is _capture.stream:
        assert _capture.graph.tape is not None
        fn, kwargs = _task_workspace(name, fn, kwargs, updating=False)
        _, result = _capture.graph.tape.call(name, fn, args, kwargs)
        return result
    return fn(*args, **kwargs)


def _task_workspace(
    name: str, fn: Callable[..., Any], kwargs: dict[str, Any], *, updating: bool
) -> tuple[Callable[..., Any], dict[str, Any]]:
    """A captured or updated task reads its workspace when the graph replays, not at the call.
    The task holds it weakly: a workspace the caller let go of is freed memory at replay, which
    raises here. An update's ``workspace=None`` makes the op size and allocate one for the
    launch and free it right after (op-plugin's EXEC_NPU_NO_FORMAT_CHECK_CMD), so every later
    replay would read freed memory: raises at replay. A capture's ``workspace=None`` is
    allocated from the graph's pool, stream-ordered with the replay: kept."""
    if not name.endswith(".out") or "workspace" not in kwargs:
        return fn, kwargs
    ws = kwargs["workspace"]
    if ws is None:
        if not updating:
            return fn, kwargs
        marker: Any = _temporary_workspace
    else:
        import torch

        if not isinstance(ws, torch.Tensor):
            return fn, kwargs  # the op refuses it
        marker = weakref.ref(ws)
    return functools.partial(_with_workspace, fn, name), {**kwargs, "workspace": marker}


def _temporary_workspace() -> None:
    """Marks a task whose workspace was allocated for its update's launch only."""


def _with_workspace(fn: Callable[..., Any], name: str, *args: Any, **kwargs: Any) -> Any:
    ws = kwargs["workspace"]
    if ws is _temporary_workspace:
        raise NpuGraphError(
            f"{name}: the task's workspace was allocated for its update (workspace=None) and "
            "freed when the update returned; the replay would read freed memory (pass a "
            "workspace kept for the graph's life, sized with _get_max_workspace)"
        )
    tensor = ws()
    if tensor is None:
        raise NpuGraphError(
            f"{name}: the task's workspace was freed (nothing holds it any more); the replay "
            "would read freed memory (keep one workspace per captured graph alive)"
        )
    return fn(*args, **{**kwargs, "workspace": tensor})


emulator.graph_dispatch = _dispatch
