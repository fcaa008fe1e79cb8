"""What the adapter uses of vLLM, read from the adapter's own source, and whether a vLLM (or
vllm-ascend) wheel still offers it, read from the wheel; both with ``ast``, nothing imported.

The list of what is used is derived from ``attnhub_vllm``'s code, never written by hand:

- every ``from vllm... import NAME`` (module-level or inside a function);
- ``NAME.attr`` on an imported vLLM class (enum members such as ``AttentionCGSupport.NEVER``,
  ``AttentionBackendEnum.CUSTOM``, ``CUDAGraphMode.FULL``);
- calls of imported vLLM functions (``register_backend(...)``, ``get_layers_from_vllm_config``):
  their positional count and keywords;
- attributes read on what an imported function returns (``get_forward_context().attn_metadata``:
  fields of the class its return annotation names);
- the fields of ``CommonAttentionMetadata`` read on a variable named ``cm`` or
  ``common_attn_metadata`` (the adapter's names for it);
- the methods of the adapter's classes that override a method of their vLLM base (as found in
  a reference wheel, the vLLM the adapter's tests run against): the name, order and kind of the
  base's parameters;
- the methods of the adapter's impl class that vLLM's base does not have: hooks vllm-ascend
  calls on ``impl_cls`` (``update_full_graph_params`` -> ``impl_cls.update_graph_params``).
"""

from __future__ import annotations

import ast
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

#: The adapter's names for vLLM's CommonAttentionMetadata.
CM_NAMES = ("cm", "common_attn_metadata")
CM_CLASS = ("vllm.v1.attention.backend", "CommonAttentionMetadata")


@dataclass(frozen=True)
class Call:
    module: str
    name: str
    positional: int
    keywords: frozenset[str]
    where: str


@dataclass(frozen=True)
class Override:
    module: str  # where the adapter imports the base from
    base: str
    cls: str  # the adapter's class
    method: str
    node: ast.FunctionDef = field(compare=False, hash=False)
    where: str = ""


@dataclass
class Uses:
    imports: set[tuple[str, str]] = field(default_factory=set)
    members: set[tuple[str, str, str]] = field(default_factory=set)
    calls: set[Call] = field(default_factory=set)
    returned: set[tuple[str, str, str]] = field(default_factory=set)  # (module, function, attr)
    fields: set[str] = field(default_factory=set)
    methods: list[Override] = field(default_factory=list)
    called: set[str] = field(default_factory=set)  # x.NAME(...) calls inside the adapter


def _vllm_imports(tree: ast.Module) -> dict[str, tuple[str, str]]:
    out = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and not node.level
            and (node.module == "vllm" or node.module.startswith("vllm."))
        ):
            for alias in node.names:
                out[alias.asname or alias.name] = (node.module, alias.name)
    return out


def _base_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Subscript):  # AttentionMetadataBuilder[AttnhubVllmMetadata]
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def adapter_uses(package: Path) -> Uses:
    """What the adapter package at ``package`` uses of vLLM (see the module docstring)."""
    uses = Uses()
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        imported = _vllm_imports(tree)
        uses.imports |= set(imported.values())
        for node in ast.walk(tree):
            where = f"{path.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id in imported:
                    uses.members.add((*imported[node.value.id], node.attr))
                elif node.value.id in CM_NAMES:
                    uses.fields.add(node.attr)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name)
                and node.value.func.id in imported
            ):
                uses.returned.add((*imported[node.value.func.id], node.attr))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                uses.called.add(node.func.attr)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in imported
            ):
                module, name = imported[node.func.id]
                kws = frozenset(k.arg for k in node.keywords if k.arg is not None)
                uses.calls.add(Call(module, name, len(node.args), kws, where))
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    name = _base_name(base)
                    if name in imported:
                        module, base_name = imported[name]
                        for item in node.body:
                            if isinstance(item, ast.FunctionDef):
                                uses.methods.append(
                                    Override(
                                        module,
                                        base_name,
                                        node.name,
                                        item.name,
                                        item,
                                        f"{path.name}:{item.lineno}",
                                    )
                                )
    return uses


# --- a wheel, read ---------------------------------------------------------------------------


class Wheel:
    """The Python modules of a wheel, parsed on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._zip = zipfile.ZipFile(path)
        self._names = set(self._zip.namelist())
        self._trees: dict[str, ast.Module | None] = {}

    def source(self, member: str) -> str:
        return self._zip.read(member).decode()

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._trees:
            base = dotted.replace(".", "/")
            tree = None
            for member in (base + ".py", base + "/__init__.py"):
                if member in self._names:
                    tree = ast.parse(self.source(member), member)
                    break
            self._trees[dotted] = tree
        return self._trees[dotted]

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """Where ``module``'s name ``name`` is defined: (module, node), following
        re-exports (``from .x import name``)."""
        tree = self.module(module)
        if tree is None or depth > 5:
            return None
        if self.module(f"{module}.{name}") is not None:  # a submodule
            return f"{module}.{name}", ast.Pass()
        for node in _top_level(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name == name:
                    return module, node
            elif isinstance(node, ast.Assign):
                if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                    return module, node
            elif isinstance(node, ast.AnnAssign):
                if isinstance(node.target, ast.Name) and node.target.id == name:
                    return module, node
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        source = _absolute(module, node, self.module(module + ".__init__"))
                        if source is not None:
                            return self.resolve(source, alias.name, depth + 1)
        # a module-level __getattr__ (lazy attributes): the name is provided, not parsed
        if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
            return module, ast.Pass()
        return None

    def cls(self, module: str, name: str) -> tuple[str, ast.ClassDef] | None:
        found = self.resolve(module, name)
        if found is None or not isinstance(found[1], ast.ClassDef):
            return None
        return found[0], found[1]

    def bases(self, module: str, cls: ast.ClassDef) -> Iterator[tuple[str, ast.ClassDef]]:
        for base in cls.bases:
            name = _base_name(base)
            if name is not None:
                found = self.cls(module, name)
                if found is not None:
                    yield found

    def members(self, module: str, cls: ast.ClassDef, depth: int = 0) -> set[str]:
        """Names a class body defines (fields, enum members, methods), its vLLM bases' too."""
        out: set[str] = set()
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.Assign):
                out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out.add(node.target.id)
        if depth < 5:
            for m, base in self.bases(module, cls):
                out |= self.members(m, base, depth + 1)
        return out

    def method(
        self, module: str, cls: ast.ClassDef, name: str, depth: int = 0
    ) -> ast.FunctionDef | None:
        for node in cls.body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node
        if depth < 5:
            for m, base in self.bases(module, cls):
                found = self.method(m, base, name, depth + 1)
                if found is not None:
                    return found
        return None


def _top_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """Module-level statements, those under ``if`` / ``try`` included."""
    stack = list(reversed(tree.body))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If):
            stack.extend(reversed(node.body + node.orelse))
        elif isinstance(node, ast.Try):
            stack.extend(reversed(node.body + node.orelse + node.finalbody))
            for h in node.handlers:
                stack.extend(reversed(h.body))
        else:
            yield node


def _absolute(module: str, node: ast.ImportFrom, package_init: ast.Module | None) -> str | None:
    if not node.level:
        return node.module
    # ``module`` is a package when the wheel has module/__init__.py
    parts = module.split(".")
    is_package = package_init is not None
    base = parts if is_package else parts[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


# --- signatures -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Signature:
    positional: tuple[str, ...]  # self / cls dropped
    required: int  # how many positional parameters have no default
    kw_only: tuple[str, ...]
    kw_required: tuple[str, ...]
    varargs: bool
    varkw: bool

    @classmethod
    def of(cls, fn: ast.FunctionDef, *, method: bool = True) -> Signature:
        """``fn``'s parameters as a caller sees them (a method's ``self`` / ``cls`` dropped,
        a staticmethod's not)."""
        a = fn.args
        positional = [p.arg for p in a.posonlyargs + a.args]
        decorators = {d.id for d in fn.decorator_list if isinstance(d, ast.Name)}
        if method and positional and "staticmethod" not in decorators:
            positional = positional[1:]  # self / cls
        n_defaults = len(a.defaults)
        required = max(len(positional) - n_defaults, 0)
        kw_required = tuple(
            p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is None
        )
        return cls(
            tuple(positional),
            required,
            tuple(p.arg for p in a.kwonlyargs),
            kw_required,
            a.vararg is not None,
            a.kwarg is not None,
        )

    def accepts(self, positional: int, keywords: frozenset[str]) -> list[str]:
        """Why a call with ``positional`` arguments and ``keywords`` would fail; empty if not."""
        problems = []
        if positional > len(self.positional) and not self.varargs:
            problems.append(f"{positional} positional arguments, it takes {len(self.positional)}")
        names = set(self.positional[positional:]) | set(self.kw_only)
        for k in sorted(keywords - names):
            if not self.varkw:
                problems.append(f"keyword {k!r} is not a parameter")
        covered = positional + len(keywords & set(self.positional[positional:]))
        if covered < self.required:
            problems.append(
                f"required parameters {list(self.positional[covered : self.required])} not given"
            )
        missing = set(self.kw_required) - keywords
        if missing:
            problems.append(f"required keyword-only {sorted(missing)} not given")
        return problems


def override_problems(base: Signature, ours: Signature) -> list[str]:
    """Why the adapter's override would not take every call vLLM makes of the base method:
    the base's positional parameters, in order, by name (vLLM calls some by keyword), its
    keyword-only ones, and nothing more required."""
    problems = []
    if ours.positional[: len(base.positional)] != base.positional:
        problems.append(
            f"vLLM's positional parameters {list(base.positional)}, the adapter's "
            f"{list(ours.positional)}"
        )
    if ours.required > base.required:
        problems.append(
            f"the adapter requires {ours.required} positional arguments, vLLM's base "
            f"{base.required}"
        )
    for k in base.kw_only:
        if k not in ours.kw_only and not ours.varkw:
            problems.append(f"keyword-only {k!r} of vLLM's method is not a parameter")
    if base.varkw and not ours.varkw:
        problems.append("vLLM's method takes **kwargs, the adapter's does not")
    return problems


def enum_values(cls: ast.ClassDef) -> dict[str, object]:
    """``NAME = constant`` members of an enum's body."""
    out: dict[str, object] = {}
    for node in cls.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                try:
                    out[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    out[target.id] = None
    return out


def hook_calls(wheel: Wheel, method: str, package: str) -> list[tuple[str, ast.Call]]:
    """Every call of ``method`` on an attention impl in the wheel's ``package``: ``X.impl.
    method(...)`` (vLLM calls a layer's impl) or ``impl_cls.method(...)`` (vllm-ascend calls
    the backend's impl class): (member, call)."""
    out = []
    for member in sorted(wheel._names):
        if not (member.startswith(package + "/") and member.endswith(".py")):
            continue
        text = wheel.source(member)
        if f".{method}(" not in text:
            continue
        for node in ast.walk(ast.parse(text, member)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            receiver = node.func.value
            on_impl = (isinstance(receiver, ast.Attribute) and receiver.attr == "impl") or (
                isinstance(receiver, ast.Name) and receiver.id == "impl_cls"
            )
            if node.func.attr == method and on_impl:
                out.append((member, node))
    return out
