"""The emulated ``torch.npu`` graph API (``attnhub_ascend.npu_graph``) matches torch_npu's.

The graph API is not in the op YAML: ``torch_npu`` defines it in Python
(``torch_npu/npu/graphs.py``: NPUGraph, graph, the task-group calls; ``streams.py``: Stream,
Event, ExternalEvent; ``utils.py``: stream, current_stream, synchronize), which ``import
torch_npu`` patches into ``torch.npu``. Those sources are read out of the same wheel as the
op schemas (a zip, never imported) and every emulated function's and method's parameters
(names, kinds, defaults) are compared with them.
"""

from __future__ import annotations

import ast
import inspect
import zipfile
from typing import Any

import npu_schema
import pytest
from attnhub_ascend import npu_graph

pytestmark = pytest.mark.contract

#: (wheel source, qualified name there, the emulated object). ``__new__`` of the C-backed
#: classes is compared with the emulator's ``__init__`` (both after cls/self).
SURFACE: list[tuple[str, str, Any]] = [
    ("graphs.py", "is_current_stream_capturing", npu_graph.is_current_stream_capturing),
    ("graphs.py", "graph_pool_handle", npu_graph.graph_pool_handle),
    ("graphs.py", "graph_task_group_begin", npu_graph.graph_task_group_begin),
    ("graphs.py", "graph_task_group_end", npu_graph.graph_task_group_end),
    ("graphs.py", "graph_task_update_begin", npu_graph.graph_task_update_begin),
    ("graphs.py", "graph_task_update_end", npu_graph.graph_task_update_end),
    ("graphs.py", "NPUGraph.capture_begin", npu_graph.NPUGraph.capture_begin),
    ("graphs.py", "NPUGraph.capture_end", npu_graph.NPUGraph.capture_end),
    ("graphs.py", "NPUGraph.replay", npu_graph.NPUGraph.replay),
    ("graphs.py", "NPUGraph.reset", npu_graph.NPUGraph.reset),
    ("graphs.py", "NPUGraph.pool", npu_graph.NPUGraph.pool),
    ("graphs.py", "graph.__init__", npu_graph.graph.__init__),
    ("streams.py", "Stream.__new__", npu_graph.Stream.__init__),
    ("streams.py", "Stream.wait_event", npu_graph.Stream.wait_event),
    ("streams.py", "Stream.wait_stream", npu_graph.Stream.wait_stream),
    ("streams.py", "Stream.record_event", npu_graph.Stream.record_event),
    ("streams.py", "Stream.synchronize", npu_graph.Stream.synchronize),
    ("streams.py", "Stream.query", npu_graph.Stream.query),
    ("streams.py", "Event.__new__", npu_graph.Event.__init__),
    ("streams.py", "Event.record", npu_graph.Event.record),
    ("streams.py", "Event.wait", npu_graph.Event.wait),
    ("streams.py", "Event.query", npu_graph.Event.query),
    ("streams.py", "Event.synchronize", npu_graph.Event.synchronize),
    ("streams.py", "ExternalEvent.__new__", npu_graph.ExternalEvent.__init__),
    ("streams.py", "ExternalEvent.record", npu_graph.ExternalEvent.record),
    ("streams.py", "ExternalEvent.wait", npu_graph.ExternalEvent.wait),
    ("streams.py", "ExternalEvent.reset", npu_graph.ExternalEvent.reset),
    ("utils.py", "current_stream", npu_graph.current_stream),
    ("utils.py", "stream", npu_graph.stream),
    ("utils.py", "synchronize", npu_graph.synchronize),
]

Param = tuple[str, str, str]  # name, kind, default (repr; "" = required)


@pytest.fixture(scope="module")
def sources() -> dict[str, ast.Module]:
    path, why = npu_schema.find_or_download_wheel()
    if path is None:
        pytest.skip(f"cannot download {npu_schema.WHEEL_REQUIREMENT} for the contract: {why}")
    out = {}
    with zipfile.ZipFile(path) as wheel:
        for name in ("graphs.py", "streams.py", "utils.py"):
            out[name] = ast.parse(wheel.read(f"torch_npu/npu/{name}").decode())
    return out


def _find(module: ast.Module, qualname: str) -> ast.FunctionDef:
    body: list[ast.stmt] = module.body
    *classes, func = qualname.split(".")
    for cls in classes:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == func)


def _vendor_params(fn: ast.FunctionDef, method: bool) -> list[Param]:
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults))
    defaults += list(a.defaults)
    params = [
        (p.arg, "positional", "" if d is None else repr(ast.literal_eval(d)))
        for p, d in zip(positional, defaults, strict=True)
    ]
    params += [
        (p.arg, "keyword-only", "" if d is None else repr(ast.literal_eval(d)))
        for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)
    ]
    if a.kwarg is not None:
        params.append((a.kwarg.arg, "var-keyword", ""))
    return params[1:] if method else params


_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "positional",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
    inspect.Parameter.KEYWORD_ONLY: "keyword-only",
    inspect.Parameter.VAR_KEYWORD: "var-keyword",
}


def _emulated_params(obj: Any, method: bool) -> list[Param]:
    params = [
        (
            p.name,
            _KINDS[p.kind],
            "" if p.default is inspect.Parameter.empty else repr(p.default),
        )
        for p in inspect.signature(obj).parameters.values()
    ]
    return params[1:] if method else params


@pytest.mark.parametrize(
    ("source", "qualname", "emulated"), SURFACE, ids=[q for _, q, _ in SURFACE]
)
def test_emulated_graph_api_matches_torch_npu(
    sources: dict[str, ast.Module], source: str, qualname: str, emulated: Any
) -> None:
    method = "." in qualname
    vendor = _vendor_params(_find(sources[source], qualname), method)
    assert _emulated_params(emulated, method) == vendor, (
        f"torch_npu/npu/{source}: {qualname}{vendor}"
    )


def test_the_exported_graph_api_is_what_the_emulation_provides(
    sources: dict[str, ast.Module],
) -> None:
    """Every name of graphs.py's ``__all__`` the backend or the adaptor uses is emulated."""
    exported = next(
        ast.literal_eval(n.value)
        for n in sources["graphs.py"].body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "__all__"
    )
    used = {
        "is_current_stream_capturing",
        "graph_pool_handle",
        "graph_task_group_begin",
        "graph_task_group_end",
        "graph_task_update_begin",
        "graph_task_update_end",
        "NPUGraph",
        "graph",
    }
    assert used <= set(exported)
    assert all(hasattr(npu_graph, name) for name in used)
