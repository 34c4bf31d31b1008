"""Imports run one way, top to bottom (the project's design notes): entrypoints -> engine
-> executor -> worker -> model_executor / core -> attention / distributed -> the leaf
modules, with no cycles, and the core importable without torch.

The graph is read from the source with `ast` (nothing of pagedllm is imported), so a
violation shows even where the import would have worked at run time. An edge is what an
import statement names (`from pagedllm.x import y` is pagedllm.x.y when that is a module,
else pagedllm.x); imports under `if TYPE_CHECKING:` are not edges, and imports inside a
function are "deferred": they run on call, so they cannot fail at import time, but they
still count as a dependency for the direction and cycle rules below.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pagedllm"

# Top to bottom. A module may import its own package and anything in a lower layer; the
# modules named in no layer are leaves (config, sampling_params, outputs, metrics, memory,
# model_source, pdl, tokenizers), which may import only each other.
LAYERS: list[tuple[str, ...]] = [
    ("pagedllm.entrypoints",),
    ("pagedllm.engine",),
    ("pagedllm.executor",),
    ("pagedllm.worker",),
    ("pagedllm.model_executor", "pagedllm.core"),
    ("pagedllm.attention", "pagedllm.distributed"),
]
# What the scheduler and the block manager may use besides themselves: pure-Python leaves.
CORE_MAY_IMPORT = ("pagedllm.config", "pagedllm.sampling_params")


@dataclass(frozen=True)
class Import:
    source: str
    target: str  # a module of pagedllm
    line: int
    deferred: bool  # inside a function


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _lazy_exports() -> dict[str, str]:
    """pagedllm/__init__'s table of public name -> defining module (its exports are lazy,
    so `from pagedllm import LLM` is an import of pagedllm.entrypoints.llm)."""
    for node in ast.parse((PACKAGE / "__init__.py").read_text()).body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets):
                return ast.literal_eval(node.value)
    return {}


EXPORTS = _lazy_exports()


def _containing_module(name: str) -> str | None:
    while name not in MODULES:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> tuple[list[str], list[str]]:
    """(pagedllm modules, top-level names of other packages) that one statement imports."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        ours = [m for n in names if n.split(".")[0] == "pagedllm" and (m := _containing_module(n))]
        return ours, [n.split(".")[0] for n in names if n.split(".")[0] != "pagedllm"]
    base = node.module or ""
    if node.level:  # relative: from the package this module is in (or is)
        package = module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]
        for _ in range(node.level - 1):
            package = package.rsplit(".", 1)[0]
        base = f"{package}.{base}" if base else package
    if base.split(".")[0] != "pagedllm":
        return [], [base.split(".")[0]]
    ours = []
    for alias in node.names:
        if f"{base}.{alias.name}" in MODULES:
            ours.append(f"{base}.{alias.name}")
        elif base == "pagedllm" and alias.name in EXPORTS:
            ours.append(EXPORTS[alias.name])
        elif (m := _containing_module(base)) is not None:
            ours.append(m)
    return ours, []


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _scan(module: str) -> tuple[list[Import], set[str]]:
    imports: list[Import] = []
    external: set[str] = set()

    def visit(body: list[ast.stmt], deferred: bool) -> None:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                ours, other = _targets(module, node)
                imports.extend(Import(module, t, node.lineno, deferred) for t in ours if t != module)
                external.update(other)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(node.body, True)
            elif isinstance(node, ast.If) and _is_type_checking(node):
                visit(node.orelse, deferred)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    sub = getattr(node, field, None)
                    if isinstance(sub, list):  # handlers: except clauses, each with a body
                        visit(sub, deferred)

    visit(ast.parse(MODULES[module].read_text(), str(MODULES[module])).body, False)
    return imports, external


SCANS = {m: _scan(m) for m in MODULES}
IMPORTS = [i for imports, _ in SCANS.values() for i in imports]


def _where(i: Import) -> str:
    kind = "deferred " if i.deferred else ""
    return f"{i.source} -> {i.target} ({kind}import, {MODULES[i.source].relative_to(ROOT)}:{i.line})"


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def dfs(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(edges.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (cycle := dfs(w)):
                return cycle
        path.pop()
        state[v] = 2
        return None

    for v in sorted(edges):
        if v not in state and (cycle := dfs(v)):
            return cycle
    return None


def _graph(include_deferred: bool) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in IMPORTS:
        if include_deferred or not i.deferred:
            edges[i.source].add(i.target)
    return edges


def _layer(module: str) -> tuple[str, int]:
    """(the unit a module belongs to, its height: 0 for leaves)."""
    for height, packages in zip(range(len(LAYERS), 0, -1), LAYERS, strict=True):
        for package in packages:
            if module == package or module.startswith(package + "."):
                return package, height
    return ".".join(module.split(".")[:2]), 0


def test_the_graph_was_read():
    """Guards the other tests against passing on an empty or misread graph."""
    assert {"pagedllm.core.scheduler", "pagedllm.engine.llm_engine"} <= MODULES.keys()
    assert any(i.target == "pagedllm.core.scheduler" for i in IMPORTS)
    assert EXPORTS["LLM"] == "pagedllm.entrypoints.llm"


def test_no_import_cycles_at_module_level():
    cycle = _find_cycle(_graph(include_deferred=False))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_cycle_closed_by_a_deferred_import():
    """An import inside a function dodges the failure of a cycle, not the cycle: the two
    modules still cannot be understood, tested or moved apart."""
    cycle = _find_cycle(_graph(include_deferred=True))
    assert cycle is None, "import cycle (through a deferred import): " + " -> ".join(cycle or [])


def test_imports_run_down_the_layers():
    upward = []
    for i in IMPORTS:
        if i.source == "pagedllm":
            continue  # the package's face: its exports are lazy (checked below)
        (unit, height), (target_unit, target_height) = _layer(i.source), _layer(i.target)
        if unit != target_unit and target_height >= height and not height == target_height == 0:
            upward.append(_where(i))
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


@pytest.mark.parametrize(
    "module",
    [m for m in MODULES if _layer(m)[0] == "pagedllm.core"] + list(CORE_MAY_IMPORT),
)
def test_core_and_its_leaves_are_pure_python(module):
    """The scheduler and block manager run (and are tested) with no torch installed: they,
    and what they import, use the standard library and each other only."""
    imports, external = SCANS[module]
    allowed = [t for t in (i.target for i in imports) if _layer(t)[0] == "pagedllm.core"
               or t in CORE_MAY_IMPORT]
    bad = [_where(i) for i in imports if i.target not in allowed]
    bad += sorted(external - set(sys.stdlib_module_names) - {"__future__"})
    assert not bad, f"{module} imports beyond the standard library and the core:\n" + "\n".join(bad)


def test_nothing_below_the_entrypoints_imports_them():
    """Benchmarks, the CLI and the server are entrypoints: the engine must not need them."""
    up = [_where(i) for i in IMPORTS
          if i.target.startswith("pagedllm.entrypoints")
          and not i.source.startswith("pagedllm.entrypoints") and i.source != "pagedllm"]
    assert not up, "imports of the entrypoints from below:\n" + "\n".join(up)


def test_the_package_exports_lazily():
    """`pagedllm/__init__` runs before any submodule: at module level it imports nothing of
    pagedllm, and every public name it lists is in its table of lazy exports."""
    import_lines = [_where(i) for i in SCANS["pagedllm"][0] if not i.deferred]
    assert import_lines == []
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    all_names = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets))
    assert set(all_names) - {"__version__"} == set(EXPORTS)
    assert all(module in MODULES for module in EXPORTS.values())


def test_core_imports_without_torch():
    """The same promise checked at run time: a fresh interpreter imports the core and its
    leaves, and neither torch nor transformers (nor numpy) is loaded."""
    code = (
        "import sys\n"
        "import pagedllm.core.block_manager, pagedllm.core.request, pagedllm.core.scheduler\n"
        "import pagedllm.config, pagedllm.sampling_params\n"
        "print(sorted({'torch', 'transformers', 'numpy'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"
