"""The import graph of src/spotguard has no circle.

Every ``import`` and ``from … import`` of a spotguard module is an edge — at module level, under
``if TYPE_CHECKING:`` and inside functions alike: a circle drawn only for the type checker
still ties two modules into one. ``from pkg import name`` is an edge to ``pkg.name`` when that
is a module, else to ``pkg``. The implicit run of a package's ``__init__`` is not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name → (file, is a package's ``__init__``)."""
    out = {}
    for path in sorted((SRC / "spotguard").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def _imports(name: str, path: Path, package: bool, known: set[str]) -> set[str]:
    """The spotguard modules that module ``name`` imports."""
    here = name if package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    found.add(sub)
                elif base in known:
                    found.add(base)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, pkg, known) for name, (path, pkg) in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_walker_finds_a_circle_and_resolves_relative_imports() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    real = import_graph()
    assert "spotguard.agent.worker" in real["spotguard.agent.daemon"]  # from .worker import …
    assert "spotguard.agent.startup" in real["spotguard.agent.daemon"]  # from . import startup


#: circles known and being taken apart elsewhere; each must go (the test fails once it has,
#: so that it is taken off this list)
KNOWN: list[list[str]] = []


def test_src_has_no_import_circle() -> None:
    found = circles(import_graph())
    new = [c for c in found if c not in KNOWN]
    assert new == [], "import circles in src/spotguard: " + "; ".join(" ↔ ".join(c) for c in new)
    gone = [c for c in KNOWN if c not in found]
    assert gone == [], f"no longer a circle, take it off KNOWN: {gone}"


def test_the_checkpoint_command_loads_no_controller_models_nor_container_backends() -> None:
    """What ``spotguard checkpoint`` imports before its freeze is the user's wait (issue 25,
    item 5): the controller's ~50 wire models (``contracts``) and the container backends
    (``dispatch`` and what it pulls in) are not needed for a process job, and once crept
    back onto that path through a GPU group's messages and a container's spec."""
    import subprocess
    import sys

    probe = (
        "import sys, spotguard.commands.checkpoint, spotguard.operations.checkpoint\n"
        "heavy = ['spotguard.contracts', 'spotguard.container.dispatch',"
        " 'spotguard.container.containerd_ops', 'spotguard.container.docker_ops']\n"
        "print(' '.join(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "", f"imported on the checkpoint path: {out.stdout.strip()}"
