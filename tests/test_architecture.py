"""The house rules of fastagg/ (issue 41), checked by reading the source: no import of fastagg is needed.

Every ``.py`` under ``fastagg/`` except ``fastagg/sim/``, ``fastagg/flower/`` and ``fastagg/nvflare.py`` (the
integrations, which sit on top of everything and are out of scope) is parsed with :mod:`ast`, and EVERY import of a
fastagg module in it is collected: at the top, inside functions, inside ``if`` / ``try``. An edge ``a -> b`` means
"running module a's code imports module b". The rules, one test each:

- the import graph has no cycle (``test_no_import_cycle``);
- every module has a layer and imports only from its own layer or lower ones (``test_every_module_has_a_layer``,
  ``test_no_upward_import``);
- only ``fastagg/backends/`` itself imports a backend module; the rest goes through the dispatch in
  ``fastagg/backends/__init__.py`` (``test_backends_only_through_the_dispatch``);
- no fastagg module is imported inside a function, where it would hide a cycle (``test_no_function_level_import``);
- no module is longer than 600 lines, no class longer than 300 (``test_no_oversized_module_or_class``).

How an import becomes edges (the way Python runs it):

- ``import fastagg.a.b`` / ``from fastagg.a.b import y`` / ``from .a.b import y``: an edge to ``fastagg.a.b``, and
  to the package ``fastagg.a`` too, because importing a submodule first runs its package's ``__init__.py``. The
  packages that contain the importing module itself are left out (they are already running when it runs);
- ``from .a import y``: also an edge to ``fastagg.a.y`` when ``y`` is a submodule;
- ``from . import x``: an edge to the submodule ``x`` when there is one, else to the package's ``__init__`` (``x`` is
  a name defined there). So a submodule that imports a name from its own package's ``__init__``, which imports the
  submodule back, IS a cycle;
- ``importlib.import_module("...")`` with a string (``fastagg/__init__.py``'s lazy ``__getattr__``, the backend
  dispatch's Triton import) is not an import statement and is not counted.

The checks are plain functions of a package root, so the tests at the bottom run them on small synthetic packages
written into ``tmp_path`` to prove each one fails when it should.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import re
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "fastagg"  # the package the checks walk; the tests of the test pass another root

# Out of scope: the integrations on top of the core. They are not walked; a core module importing one of them is an
# upward import (they sit above every layer).
OUT_OF_SCOPE = ("fastagg.sim", "fastagg.flower", "fastagg.nvflare")

# The layers, bottom to top. A module imports only modules of its own layer or lower ones; inside a layer any
# direction is allowed (the cycle check still applies). A package listed here covers its submodules (so a new file in
# fastagg/server/ is layer 7), except the root package "fastagg", which stands for fastagg/__init__.py alone: a new
# top-level module must be added to a layer here.
LAYERS: tuple[tuple[str, ...], ...] = (
    # 1. foundations: argument checks, aliasing and buffer helpers, docstring helpers, optional-dependency hints,
    #    signal masking, the flat layout, the row table's C layout, the flat-combining queue, FedExP's step size
    #    (fedexp_rule), the optimizer checkpoint file format (checkpoint)
    ("fastagg._checks", "fastagg._facts", "fastagg._aliasing", "fastagg._buffers", "fastagg._docs", "fastagg._optional",
     "fastagg._uninterruptible", "fastagg.flat", "fastagg.rowtable", "fastagg.combining", "fastagg.fedexp_rule",
     "fastagg.checkpoint", "fastagg._version"),
    # 2. the row table: a round's client updates and the parameters as rows the kernels read
    ("fastagg.rows",),
    # 3. the backends: the dispatch (backends/__init__.py: resolve / available / dispatch functions) and the backend
    #    modules under it (reference, cpu, triton). Outside fastagg/backends/ only the dispatch may be imported.
    ("fastagg.backends",),
    # 4. the compressed formats, the stats passes, then the compressed fold that runs them over compressed rows
    ("fastagg.compress", "fastagg.passes", "fastagg.compress.fold"),
    # 5. torch.distributed rounds, robust rules, differential privacy
    ("fastagg.distributed", "fastagg.robust", "fastagg.privacy"),
    # 6. a round's result and the functional apply (result), the streaming Accumulator (stream)
    ("fastagg.result", "fastagg.stream"),
    # 7. the one input path (inputs), the functional API (ops), the server optimizers (server)
    ("fastagg.inputs", "fastagg.ops", "fastagg.server"),
    # 8. what users call on top: client steps, host feeding, environment report, async FedBuff, test helpers, the
    #    demo, the memory check, and the package itself (fastagg/__init__.py: lazy submodules by name)
    ("fastagg.client", "fastagg.feed", "fastagg.env", "fastagg.asynchronous", "fastagg.testing", "fastagg.demo",
     "fastagg._memcheck", "fastagg"),
)

MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300
# (module or "module.Class", reason): only with the coordinator's agreement. None today.
SIZE_EXEMPTIONS: dict[str, str] = {}

# Extension modules setup.py compiles from csrc/ that a module imports by name at its top (leaves: they import no
# fastagg module). fastagg._C / _C_avx2 are loaded by fastagg/backends/cpu.py's ISA choice instead.
COMPILED = ("fastagg._tensor_facts",)

BACKENDS = "fastagg.backends"  # the dispatch; everything below it is a backend module

# The one module a lower layer may import inside a function (docs/ARCHITECTURE.md, "Lazy imports"), and why. Such an
# import is still an edge of the cycle and layer checks (it must point downward); it is only spared the
# function-level rule. A new entry needs a reason this strong.
LAZY: dict[str, str] = {
    "fastagg.distributed": "loaded by the first round over a torch.distributed group (fastagg/inputs.py, "
                           "fastagg/stream/steps.py), so import fastagg does not load it (tests/test_user_habits.py); "
                           "its collectives cannot move below, since tests patch its module globals (run_stats, "
                           "ONE_RANK_IS_LOCAL) and expect every step over a group to see the patch",
}


@dataclasses.dataclass(frozen=True)
class Edge:
    importer: str  # dotted module name
    target: str  # dotted module name
    path: Path
    line: int
    statement: str  # the import as written
    in_function: bool


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _out_of_scope(name: str) -> bool:
    return any(name == o or name.startswith(o + ".") for o in OUT_OF_SCOPE)


def all_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package under ``root`` (out-of-scope ones included), dotted name -> file."""
    return {_module_name(p, root): p for p in sorted(root.rglob("*.py")) if "__pycache__" not in p.parts}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """The modules the rules apply to."""
    return {name: path for name, path in all_modules(root).items() if not _out_of_scope(name)}


def _statement(node: ast.AST) -> str:
    return ast.unparse(node)


def _ancestors(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _targets(importer: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str],
             top: str) -> set[str]:
    """The fastagg modules one import statement runs (see the module docstring)."""
    named: set[str] = set()  # the modules the statement names, or reads names from
    if isinstance(node, ast.Import):
        named = {a.name for a in node.names if a.name == top or a.name.startswith(top + ".")}
    else:
        if node.level:
            package = importer if is_package else importer.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{node.module}" if node.module else package
        else:
            base = node.module or ""
        if base == top or base.startswith(top + "."):
            named = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
            if len(named) < len(node.names):
                named.add(base)  # reads a name defined in base (its __init__, when base is a package)
    # importing a.b runs the package a first, unless a contains the importer (then it is already running)
    implied = {parent for name in named for parent in _ancestors(name)} - _ancestors(importer)
    return (named | implied) - {importer}


def edges(root: Path = ROOT) -> list[Edge]:
    """Every import of a fastagg module by an in-scope module, with where it is written (parsed once per state of
    the files: each check calls this)."""
    files = tuple((p, p.stat().st_mtime_ns, p.stat().st_size) for p in all_modules(root).values())
    return list(_edges(root, files))


@functools.lru_cache(maxsize=16)
def _edges(root: Path, files: tuple) -> tuple[Edge, ...]:
    top = root.name
    everything = all_modules(root)
    known = set(everything) | {m for m in COMPILED if m.startswith(top + ".")}
    out: list[Edge] = []
    for importer, path in modules(root).items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"

        def visit(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in sorted(_targets(importer, is_package, child, known, top)):
                        out.append(Edge(importer, target, path, child.lineno, _statement(child), in_function))
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(tree, False)
    return tuple(out)


def _where(edge: Edge, root: Path) -> str:
    return f"{edge.path.relative_to(root.parent)}:{edge.line}: {edge.statement}"


# ---------------------------------------------------------------------------------------------------------- checks
def layer_of(name: str) -> int | None:
    """The layer (1 = lowest) of a module: the longest listed name it is, or is inside of; None when unassigned."""
    best, best_len = None, -1
    for number, layer in enumerate(LAYERS, start=1):
        for listed in layer:
            inside = name == listed or (listed != "fastagg" and name.startswith(listed + "."))
            if inside and len(listed) > best_len:
                best, best_len = number, len(listed)
    return best


def unassigned(root: Path = ROOT) -> list[str]:
    return [f"assign {name} a layer ({path.relative_to(root.parent)})"
            for name, path in modules(root).items() if layer_of(name) is None]


def upward_imports(root: Path = ROOT) -> list[str]:
    problems = []
    for e in edges(root):
        low = layer_of(e.importer)
        if low is None:
            continue  # reported by unassigned()
        if _out_of_scope(e.target):
            problems.append(f"{e.importer} (layer {low}) imports {e.target}, an integration above every layer: "
                            f"{_where(e, root)}")
            continue
        high = layer_of(e.target)
        if high is not None and high > low:
            problems.append(f"{e.importer} (layer {low}) imports {e.target} (layer {high}): {_where(e, root)}")
    return problems


def backend_bypasses(root: Path = ROOT) -> list[str]:
    return [f"{e.importer} imports the backend module {e.target} directly: {_where(e, root)}"
            for e in edges(root)
            if e.target.startswith(BACKENDS + ".") and not (e.importer == BACKENDS
                                                            or e.importer.startswith(BACKENDS + "."))]


# Where a module may be loaded by a name in a string (importlib / __import__): the package's lazy submodules
# (fastagg/__init__.py) and the backend choice (fastagg/backends/, which loads the compiled _C and Triton on demand).
DYNAMIC_IMPORTERS = ("fastagg", "fastagg.backends")
_BACKEND_MODULES = ("cpu", "reference", "triton")


def _string_of(node: ast.AST) -> str | None:
    """The literal start of a string argument (a constant, or an f-string's leading text), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value)
    return None


def hidden_imports(root: Path = ROOT) -> list[str]:
    """What the ast walk of import statements cannot see: a fastagg module loaded by a name in a string
    (``importlib.import_module``, ``__import__``, ``exec`` / ``eval`` of an import, ``sys.modules[...]``) outside
    DYNAMIC_IMPORTERS, and a backend module reached as an attribute of ``fastagg.backends`` outside fastagg/backends/
    (``from fastagg import backends; backends.reference.x``)."""
    top, problems = root.name, []
    for name, path in modules(root).items():
        allowed = name in DYNAMIC_IMPORTERS or name.startswith(BACKENDS + ".")
        tree = ast.parse(path.read_text(), filename=str(path))
        backend_names = set()  # local names bound to the fastagg.backends package
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                for _ in range(max(node.level - 1, 0)):
                    package = package.rpartition(".")[0]
                base = (f"{package}.{node.module}" if node.module else package) if node.level else (node.module or "")
                backend_names |= {a.asname or a.name for a in node.names if f"{base}.{a.name}" == BACKENDS}
            elif isinstance(node, ast.Import):
                backend_names |= {a.asname for a in node.names if a.name == BACKENDS and a.asname}
        rel = path.relative_to(root.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and not allowed:
                fn = node.func
                fname = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
                text = _string_of(node.args[0]) if node.args else None
                if fname in ("import_module", "__import__") and text is not None and \
                        (text == top or text.startswith((top + ".", "."))):
                    problems.append(f"{rel}:{node.lineno}: {ast.unparse(node)} (a module loaded by name, in {name})")
                elif fname in ("exec", "eval") and text is not None and f"import {top}" in text or \
                        fname in ("exec", "eval") and text is not None and f"from {top}" in text:
                    problems.append(f"{rel}:{node.lineno}: {ast.unparse(node)} (an import in a string, in {name})")
            if isinstance(node, ast.Subscript) and not allowed and ast.unparse(node.value) == "sys.modules":
                text = _string_of(node.slice)
                if text is not None and (text == top or text.startswith(top + ".")):
                    problems.append(f"{rel}:{node.lineno}: {ast.unparse(node)} (a module read from sys.modules, "
                                    f"in {name})")
            if isinstance(node, ast.Attribute) and node.attr in _BACKEND_MODULES and \
                    not name.startswith(BACKENDS) and ast.unparse(node.value) in backend_names | {BACKENDS}:
                problems.append(f"{rel}:{node.lineno}: {ast.unparse(node)} (a backend module reached through the "
                                f"package, in {name})")
    return problems


def function_level_imports(root: Path = ROOT) -> list[str]:
    """Imports of fastagg modules written inside a function, except a downward one of a LAZY module (every edge of
    the statement points at that module or a package the importer already runs)."""
    by_statement: dict[tuple, list[Edge]] = {}
    for e in edges(root):
        if e.in_function:
            by_statement.setdefault((e.path, e.line), []).append(e)
    problems = []
    for group in by_statement.values():
        lazy = all(e.target in LAZY or e.target in _ancestors(e.importer) | {root.name} for e in group) and \
            any(e.target in LAZY for e in group)
        if not lazy:
            problems.append(f"{_where(group[0], root)} (in a function, in {group[0].importer})")
    return problems


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {name: set() for name in modules(root)}
    for e in edges(root):
        if e.target in g:
            g[e.importer].add(e.target)
    return g


def cycles(root: Path = ROOT) -> list[str]:
    """One cycle per strongly connected component of the import graph (Tarjan), as ``a -> b -> a``."""
    g = graph(root)
    by_pair = {(e.importer, e.target): e for e in reversed(edges(root))}  # the first place each edge is written
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:  # recursion depth <= number of modules (~70)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            components.append(component)

    for v in sorted(g):
        if v not in index:
            strongconnect(v)
    out = []
    for component in components:
        members = set(component)
        start = min(component)
        if len(component) == 1 and start not in g[start]:
            continue
        # the shortest path start -> ... -> start inside the component (breadth first)
        previous: dict[str, str] = {}
        frontier, found = [start], None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(g[v] & members):
                    if w == start:
                        found = v
                        break
                    if w not in previous:
                        previous[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path = [start]
        v = found
        while v != start:
            path.append(v)
            v = previous[v]
        path.append(start)
        path = [path[0]] + path[1:-1][::-1] + [start]
        where = []
        for a, b in zip(path, path[1:]):
            where.append(f"    {_where(by_pair[a, b], root)}")
        extra = "" if len(component) == len(path) - 1 else f" (all of {sorted(component)} import each other)"
        out.append(" -> ".join(path) + extra + "\n" + "\n".join(where))
    return out


def oversized(root: Path = ROOT) -> list[str]:
    problems = []
    for name, path in modules(root).items():
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES and name not in SIZE_EXEMPTIONS:
            problems.append(f"{path.relative_to(root.parent)} ({name}) has {lines} lines > {MAX_MODULE_LINES}")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.ClassDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_CLASS_LINES and f"{name}.{node.name}" not in SIZE_EXEMPTIONS:
                    problems.append(f"class {node.name} in {path.relative_to(root.parent)}:{node.lineno} has "
                                    f"{length} lines > {MAX_CLASS_LINES}")
    return problems


def _report(problems: list[str], rule: str, why: str, fix: str) -> str:
    return f"{rule}\nWhy: {why}\nHow to fix: {fix}\n\n" + "\n".join(problems)


# ----------------------------------------------------------------------------------------------- the rules, on fastagg/
def test_every_package_is_shipped():
    """pyproject.toml lists the packages the wheel ships, by name: a package of fastagg/ missing there installs as
    nothing, and ``import fastagg`` fails for users while every test of the checkout passes (issue 41's split of
    server.py and stream.py into packages was caught only by CI's wheel install)."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {_module_name(init, ROOT) for init in ROOT.rglob("__init__.py")}
    missing = sorted(packages - listed)
    assert not missing, f"packages of fastagg/ missing from pyproject.toml's [tool.setuptools] packages: {missing}"


def test_no_import_cycle():
    found = cycles()
    assert not found, _report(
        found, "The import graph of fastagg/ has a cycle (each line: where one edge of it is written).",
        "a cycle means neither module can be read, tested or changed without the other, and the import order decides "
        "which half-initialised module the other sees.",
        "move the code both sides need down to a module of a lower layer (see LAYERS in this file and "
        "docs/ARCHITECTURE.md), so that the lower module no longer imports the higher one. A function-level import "
        "does not fix a cycle: it is counted here like a top-level one.")


def test_every_module_has_a_layer():
    found = unassigned()
    assert not found, _report(
        found, "A module of fastagg/ is not in any layer.",
        "the layer decides what a module may import; an unplaced module would escape the upward-import check.",
        "add its dotted name to the right layer of LAYERS in tests/test_architecture.py, and its one line to the "
        "layer list of docs/ARCHITECTURE.md.")


def test_no_upward_import():
    found = upward_imports()
    assert not found, _report(
        found, "A module imports a module of a higher layer.",
        "the layers keep the core a stack a newcomer reads bottom up; an upward import is a cycle waiting to happen.",
        "move what is needed down to the importer's layer or below (or, if the importer really belongs higher, "
        "move it up in LAYERS and in docs/ARCHITECTURE.md). The out-of-scope integrations (fastagg.sim, "
        "fastagg.flower, fastagg.nvflare) sit above every layer: the core never imports them.")


def test_backends_only_through_the_dispatch():
    found = backend_bypasses()
    assert not found, _report(
        found, "A module outside fastagg/backends/ imports a backend module (cpu, reference, triton...) directly.",
        "a backend must be addable or swappable without touching the rule families; they reach backend primitives "
        "through fastagg/backends/__init__.py (resolve / available / the dispatch functions).",
        "import from fastagg.backends instead (add a small dispatch function there if the primitive has none).")


def test_no_import_hidden_in_a_string_or_an_attribute():
    found = hidden_imports()
    assert not found, _report(
        found, "A fastagg module is loaded by a name in a string, or a backend module reached as an attribute.",
        "the import rules read import statements; a module loaded by name (importlib, __import__, exec, sys.modules) "
        "or fastagg.backends.reference reached as an attribute escapes them and can hide a cycle or a bypass. Only "
        "fastagg/__init__.py (lazy submodules) and fastagg/backends/ (the backend choice) load modules by name.",
        "write a plain import at the top of the file (or call the dispatch in fastagg/backends/__init__.py).")


def test_no_function_level_import():
    found = function_level_imports()
    assert not found, _report(
        found, "A fastagg module is imported inside a function.",
        "an import inside a function hides a cycle or an upward import from whoever reads the top of the file. It "
        "is acceptable only for an optional third-party package or torch.distributed, and for a fastagg module only "
        "when it is in LAZY (one today, with its reason) and the import points downward.",
        "move the import to the top of the file; if that makes a cycle, move the code it needs to a lower layer.")


def test_no_oversized_module_or_class():
    found = oversized()
    assert not found, _report(
        found, f"A module is longer than {MAX_MODULE_LINES} lines or a class longer than {MAX_CLASS_LINES}.",
        "a module a newcomer reads in one sitting holds one job; a long class is usually several jobs in one.",
        "split by job into modules of their own (functions, not mixins); exemptions (SIZE_EXEMPTIONS) only with the "
        "maintainers' agreement.")


# ---------------------------------------------------------------------------------- the tests of the test (synthetic)
def _write(root: Path, files: dict[str, str]) -> Path:
    package = root / "fastagg"
    for relative, text in files.items():
        path = package / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


# A small house that keeps every rule (relative and absolute imports, a package, an ancestor edge, the dispatch).
CLEAN = {
    "__init__.py": "from .ops import run\nfrom .stream import Accumulator\n",
    "_checks.py": "def check_int(x):\n    return x\n",
    "rows.py": "from ._checks import check_int\nimport fastagg.flat\n",
    "flat.py": "",
    "backends/__init__.py": "from . import reference\nfrom .reference import round_stats\n\ndef resolve():\n"
                            "    import importlib\n    return importlib.import_module('fastagg.backends.cpu')\n",
    "backends/reference.py": "from ..rows import check_int\n\ndef round_stats():\n    pass\n",
    "backends/cpu.py": "from . import reference\n",
    "passes.py": "from .backends import resolve\n",
    "stream/__init__.py": "from .log import Log\n\nclass Accumulator:\n    pass\n",
    "stream/log.py": "from ..passes import resolve\n\nclass Log:\n    pass\n",
    "ops.py": "from fastagg.stream.log import Log\n\ndef run():\n    import torch.distributed as dist\n",
    "server/__init__.py": "from .base import ServerOptimizer\nfrom .fedavg import FedAvg\n",
    "server/base.py": "from ..ops import run\n\nclass ServerOptimizer:\n    pass\n",
    "server/fedavg.py": "from .base import ServerOptimizer\n\nclass FedAvg(ServerOptimizer):\n    pass\n",
    "sim/__init__.py": "from fastagg.server import FedAvg\nfrom fastagg.sim import x\n",
    "nvflare.py": "def f():\n    from .server import FedAvg\n",
}


def test_a_clean_house_passes(tmp_path):
    root = _write(tmp_path, CLEAN)
    assert cycles(root) == [] and unassigned(root) == [] and upward_imports(root) == []
    assert backend_bypasses(root) == [] and function_level_imports(root) == [] and oversized(root) == []
    g = graph(root)
    assert g["fastagg.rows"] == {"fastagg._checks", "fastagg.flat"}
    assert g["fastagg.ops"] == {"fastagg.stream", "fastagg.stream.log"}  # the package's __init__ runs first
    assert g["fastagg.server.fedavg"] == {"fastagg.server.base"}  # its own package is already running
    assert g["fastagg.backends"] == {"fastagg.backends.reference"}
    assert "fastagg.sim" not in g and "fastagg.nvflare" not in g  # out of scope: not walked


def test_a_planted_cycle_is_named(tmp_path):
    root = _write(tmp_path, {**CLEAN, "flat.py": "from .rows import something\n"})
    (found,) = cycles(root)
    assert found.splitlines()[0] == "fastagg.flat -> fastagg.rows -> fastagg.flat"
    assert "fastagg/flat.py:1: from .rows import something" in found
    assert "fastagg/rows.py:2: import fastagg.flat" in found


def test_a_submodule_reading_its_own_package_init_is_a_cycle(tmp_path):
    # fastagg/server/__init__.py imports fedavg, which reads ServerOptimizer back from the package's __init__
    root = _write(tmp_path, {**CLEAN, "server/fedavg.py": "from fastagg.server import ServerOptimizer\n"})
    (found,) = cycles(root)
    assert found.splitlines()[0] == "fastagg.server -> fastagg.server.fedavg -> fastagg.server"
    root = _write(tmp_path / "relative", {**CLEAN, "server/fedavg.py": "from . import ServerOptimizer\n"})
    assert cycles(root)[0].splitlines()[0] == "fastagg.server -> fastagg.server.fedavg -> fastagg.server"


def test_a_cycle_hidden_in_a_function_is_still_a_cycle(tmp_path):
    hidden = "def check_int(x):\n    if x:\n        try:\n            from fastagg import rows\n"
    root = _write(tmp_path, {**CLEAN, "_checks.py": hidden + "        except ImportError:\n            pass\n"})
    (found,) = cycles(root)
    assert found.splitlines()[0] == "fastagg._checks -> fastagg.rows -> fastagg._checks"
    assert function_level_imports(root) == [
        "fastagg/_checks.py:4: from fastagg import rows (in a function, in fastagg._checks)"]


def test_a_planted_upward_import_is_named(tmp_path):
    root = _write(tmp_path, {**CLEAN, "rows.py": "from .server import base\n", "passes.py": "import fastagg.sim\n",
                             "ops.py": "from . import stream\n"})
    found = upward_imports(root)
    assert ("fastagg.rows (layer 2) imports fastagg.server (layer 7): fastagg/rows.py:1: from .server import base"
            in found)
    assert ("fastagg.rows (layer 2) imports fastagg.server.base (layer 7): fastagg/rows.py:1: from .server import "
            "base" in found)
    assert any(p.startswith("fastagg.passes (layer 4) imports fastagg.sim, an integration above every layer")
               for p in found)
    assert len(found) == 3  # ops (7) importing stream (6) is downward


def test_an_unplaced_module_must_be_assigned_a_layer(tmp_path):
    root = _write(tmp_path, {**CLEAN, "newthing.py": "", "server/adaptive.py": "from .base import ServerOptimizer\n"})
    assert unassigned(root) == ["assign fastagg.newthing a layer (fastagg/newthing.py)"]  # server/* is layer 7


def test_a_planted_direct_backend_import_is_named(tmp_path):
    root = _write(tmp_path, {**CLEAN, "passes.py": "from .backends import resolve, cpu\n",
                             "stream/log.py": "from fastagg.backends.reference import round_stats\n"})
    found = backend_bypasses(root)
    assert found == [
        "fastagg.passes imports the backend module fastagg.backends.cpu directly: fastagg/passes.py:1: from "
        ".backends import resolve, cpu",
        "fastagg.stream.log imports the backend module fastagg.backends.reference directly: fastagg/stream/log.py:1: "
        "from fastagg.backends.reference import round_stats"]


def test_a_planted_function_level_import_is_named(tmp_path):
    root = _write(tmp_path, {**CLEAN, "ops.py": "class A:\n    def f(self):\n        from .stream import log\n"
                                                "        import json\n"})
    assert function_level_imports(root) == [
        "fastagg/ops.py:3: from .stream import log (in a function, in fastagg.ops)"]
    assert upward_imports(root) == [] and cycles(root) == []


def test_a_lazy_module_may_be_imported_downward_inside_a_function_and_still_counts(tmp_path):
    """LAZY's module (fastagg.distributed) loaded inside a function passes the function-level rule, but the edge
    still counts: the same import from a lower layer is an upward import, and another module imported in the same
    function is still named."""
    lazy = {**CLEAN, "distributed.py": "from .passes import resolve\n",
            "ops.py": "def run():\n    from . import distributed\n    from .stream import log\n"}
    root = _write(tmp_path / "a", lazy)
    assert function_level_imports(root) == [
        "fastagg/ops.py:3: from .stream import log (in a function, in fastagg.ops)"]
    upward = {**CLEAN, "distributed.py": "", "rows.py": "def f():\n    from .distributed import x\n"}
    root = _write(tmp_path / "b", upward)
    assert function_level_imports(root) == [] and any("fastagg.rows" in u for u in upward_imports(root))


def test_imports_hidden_in_strings_and_attributes_are_named(tmp_path):
    root = _write(tmp_path, {**CLEAN,
                             "rows.py": "import importlib\n\ndef f():\n"
                                        "    return importlib.import_module('fastagg.server')\n",
                             "passes.py": "from .backends import resolve\nx = __import__('fastagg.stream')\n",
                             "flat.py": "import sys\nexec('import fastagg.server')\ny = sys.modules['fastagg.ops']\n",
                             "stream/log.py": "from .. import backends as b\n\nclass Log:\n    r = b.reference\n"})
    found = hidden_imports(root)
    assert [f.split(":")[0] + ":" + f.split(":")[1] for f in found] == [
        "fastagg/flat.py:2", "fastagg/flat.py:3", "fastagg/passes.py:2", "fastagg/rows.py:4", "fastagg/stream/log.py:4"]
    assert hidden_imports(_write(tmp_path / "clean", CLEAN)) == []


def test_planted_oversized_module_and_class_are_named(tmp_path):
    long_class = "class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES
    fine_class = "class Fine:\n" + "    x = 1\n" * (MAX_CLASS_LINES - 1)
    root = _write(tmp_path, {**CLEAN, "rows.py": "\n" * (MAX_MODULE_LINES + 1), "flat.py": long_class + fine_class,
                             "_checks.py": "\n" * MAX_MODULE_LINES})
    assert oversized(root) == [f"fastagg/flat.py (fastagg.flat) has {2 * MAX_CLASS_LINES + 1} lines > 600",
                               "class Big in fastagg/flat.py:1 has 301 lines > 300",
                               f"fastagg/rows.py (fastagg.rows) has {MAX_MODULE_LINES + 1} lines > 600"]


# --------------------------------------------------------------------------------------------- docs/ARCHITECTURE.md
DOC = REPO / "docs" / "ARCHITECTURE.md"
_PATH = re.compile(r"(?<![\w/.])(?:fastagg|tests|csrc|docs)/[A-Za-z0-9_./-]*|(?<![\w/.])setup\.py")
_DOTTED = re.compile(r"(?<![\w/.])fastagg(?:\.[A-Za-z_]\w*)+")


def _defines(body: list, name: str) -> ast.AST | bool:
    """The node that binds ``name`` in a module's or class's ``body`` (True for an assignment or import)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name.split(".")[0]) == name
                                                                     for a in node.names):
            return True
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
    return False


def missing_citations(doc: Path = DOC, root: Path = ROOT) -> list[str]:
    """Paths (``fastagg/...``, ``tests/...``, ``csrc/...``, ``docs/...``, ``setup.py``) and dotted fastagg names the
    page cites that do not exist (a ``<placeholder>`` ends a path: its folder must exist)."""
    text = doc.read_text()
    problems = []
    for path in sorted(set(_PATH.findall(text))):
        path = path.rstrip(".")
        if not (root.parent / path).exists():
            problems.append(f"{doc.name} cites {path}, which does not exist")
    known = all_modules(root)
    for dotted in sorted(set(_DOTTED.findall(text))):
        parts = dotted.split(".")
        k = max(i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in known)
        body = ast.parse(known[".".join(parts[:k])].read_text()).body
        for i, name in enumerate(parts[k:]):
            if f"{'.'.join(parts[:k + i])}.{name}" in known:
                break  # (a submodule the parent does not import)
            node = _defines(body, name)
            if not node:
                problems.append(f"{doc.name} cites {dotted}: {'.'.join(parts[:k + i])} defines no {name!r}")
            if not isinstance(node, ast.ClassDef):
                break  # (a function's, an assignment's or an import's attributes are not followed)
            body = node.body
    return problems


def unlisted_modules(doc: Path = DOC, root: Path = ROOT) -> list[str]:
    """The in-scope modules the page's layer list does not name: neither their file nor a folder above it is cited
    (``fastagg/server/`` covers the files in it)."""
    cited = {p.rstrip(".") for p in _PATH.findall(doc.read_text())}
    out = []
    for name, path in modules(root).items():
        relative = path.relative_to(root.parent)
        folders = {f"{parent.as_posix()}/" for parent in relative.parents if parent.name}
        if relative.as_posix() not in cited and not folders & (cited - {f"{root.name}/"}):
            out.append(f"{relative} ({name})")
    return out


def test_every_module_is_on_the_architecture_page():
    found = unlisted_modules()
    assert not found, _report(
        found, "A module of fastagg/ is missing from docs/ARCHITECTURE.md's layer list.",
        "the page is the newcomer's map of the house: every module has its one line there.",
        "add the module to its layer's table in docs/ARCHITECTURE.md (one line: what it is), and to LAYERS here.")


def test_every_path_and_name_the_architecture_page_cites_exists():
    found = missing_citations()
    assert not found, _report(
        found, "docs/ARCHITECTURE.md cites a file or a fastagg name that does not exist.",
        "a newcomer follows the page to the files it names; a stale name sends them nowhere.",
        "update the page (a moved module: its new path; a renamed function: its new name).")


def test_the_citation_check_catches_a_stale_path_and_name(tmp_path):
    doc = tmp_path / "ARCHITECTURE.md"
    doc.write_text("`fastagg/rows.py`, `fastagg/server.py`, `fastagg/backends/<name>.py`, `tests/nothing.py`.\n"
                   "`fastagg.rows.client_rows`, `fastagg.rows.ClientRows.row_ptrs`, `fastagg.rows.no_such`, "
                   "fastagg.rows.ClientRows.nope, fastagg.passes.RoundStats.anything, fastagg.server.base\n")
    root = _write(tmp_path, {**CLEAN, "rows.py": "class ClientRows:\n    def row_ptrs(self):\n        pass\n\n"
                                                 "def client_rows():\n    pass\n",
                             "passes.py": "from .rows import ClientRows as RoundStats\n"})
    assert missing_citations(doc, root) == [
        "ARCHITECTURE.md cites fastagg/server.py, which does not exist",
        "ARCHITECTURE.md cites tests/nothing.py, which does not exist",
        "ARCHITECTURE.md cites fastagg.rows.ClientRows.nope: fastagg.rows.ClientRows defines no 'nope'",
        "ARCHITECTURE.md cites fastagg.rows.no_such: fastagg.rows defines no 'no_such'"]
    # the layer list names rows.py and the backends/ folder (its files); `fastagg/` alone covers nothing
    assert sorted(unlisted_modules(doc, root)) == sorted(f"fastagg/{f} ({m})" for f, m in [
        ("__init__.py", "fastagg"), ("_checks.py", "fastagg._checks"), ("flat.py", "fastagg.flat"),
        ("passes.py", "fastagg.passes"), ("stream/__init__.py", "fastagg.stream"),
        ("stream/log.py", "fastagg.stream.log"), ("ops.py", "fastagg.ops"), ("server/__init__.py", "fastagg.server"),
        ("server/base.py", "fastagg.server.base"), ("server/fedavg.py", "fastagg.server.fedavg")])


def _doc_example() -> tuple[str, str]:
    """The server rule example of docs/ARCHITECTURE.md, "Adding a server rule": (its file, its export line)."""
    text = DOC.read_text()
    section = text[text.index("## 3. Adding a server rule"):text.index("## 4. ")]
    source, export = re.findall(r"```python\n(.*?)```", section, re.S)[:2]
    return source, export.strip()


def _load_example(tmp_path: Path, monkeypatch) -> type:
    """The example's file, written into ``tmp_path`` and imported as the submodule of fastagg.server its export line
    names (its relative imports then resolve as they would in fastagg/server/)."""
    import importlib.util
    import sys

    source, export = _doc_example()
    match = re.fullmatch(r"from \.(\w+) import (\w+)", export)
    assert match, f"the example's export line is not `from .<module> import <Rule>`: {export!r}"
    module_name, rule = match.groups()
    path = tmp_path / f"{module_name}.py"
    path.write_text(source)
    name = f"fastagg.server.{module_name}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    assert module.__all__ == [rule]
    assert len(source.splitlines()) <= 45, "the example is meant to be read in one glance"
    return getattr(module, rule)


def _example_oracle(w0, rounds, lr: float, momentum: float) -> list:
    """The example's formula in float64, from its docstring: ``v <- momentum v + mean; w <- w + lr/sqrt(t+1) v``."""
    import torch

    w, v, out = w0.double(), torch.zeros(w0.numel(), dtype=torch.float64), []
    for t, (x, n) in enumerate(rounds):
        p = torch.as_tensor(n, dtype=torch.float64) / sum(n)
        v = momentum * v + p @ x.double()
        w = w + lr / (t + 1) ** 0.5 * v
        out.append(w)
    return out


def test_the_example_server_rule_steps_as_its_formula_and_checkpoints(tmp_path, monkeypatch):
    import torch

    from fastagg.testing import assert_close, cpu_backends

    rule = _load_example(tmp_path, monkeypatch)
    g = torch.Generator().manual_seed(0)
    d, lr, momentum = 53, 0.5, 0.8
    w0 = torch.randn(d, generator=g)
    rounds = [((0.1 * torch.randn(m, d, generator=g, dtype=torch.float64) + 0.02).float(),
               torch.randint(1, 20, (m,), generator=g).tolist()) for m in (3, 5, 4)]
    want = _example_oracle(w0, rounds, lr, momentum)
    for backend in cpu_backends():
        w = w0.clone()
        opt = rule(w, lr=lr, momentum=momentum, backend=backend)
        for t, (x, n) in enumerate(rounds):
            stats = opt.step(x, weights=n)
            assert bool(stats.finite)
            assert_close(w, want[t], rtol=1e-5, atol=1e-6, name=f"{backend}, round {t}")
        assert opt.round == 3

        # the rule declares _apply_reads_sum: stepping on an Accumulator reads its sum in place, same rounds
        import fastagg

        w = w0.clone()
        opt = rule(w, lr=lr, momentum=momentum, backend=backend)
        for t, (x, n) in enumerate(rounds):
            acc = fastagg.Accumulator(like=x[0], backend=backend)
            for row, weight in zip(x, n):
                acc.add(row, float(weight))
            opt.step(acc)
            assert_close(w, want[t], rtol=1e-5, atol=1e-6, name=f"{backend}, round {t} from an Accumulator")

        # a checkpoint after round 2 restores the rule exactly: round 3 from it gives the same bits
        w = w0.clone()
        opt = rule(w, lr=lr, momentum=momentum, backend=backend)
        for x, n in rounds[:2]:
            opt.step(x, weights=n)
        saved = opt.state_dict()
        w2 = w.clone()
        resumed = rule(w2, backend=backend)  # the defaults: the checkpoint brings lr and momentum back
        resumed.load_state_dict(saved)
        assert (resumed.lr, resumed.momentum, resumed.round) == (lr, momentum, 2)
        opt.step(*rounds[2][:1], weights=rounds[2][1])
        resumed.step(*rounds[2][:1], weights=rounds[2][1])
        assert torch.equal(w, w2), backend
        assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"],
                           resumed.state_dict()["state"][0]["momentum_buffer"])
