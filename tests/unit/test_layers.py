"""The import layers of docs/design/architecture.md ("Layering") and the README's source tour, checked on the source.

Every ``import`` of ``umbp``, ``transport`` and ``metaserver`` modules is read from the syntax tree, function-level
(lazy) imports included, ``if TYPE_CHECKING:`` blocks not (annotations only). A module may import its own layer or
those below it; the metaserver and the pool's processes and client (the same layer) never import each other; inside
the metaserver the packages stack table < store < handlers < ha < the process; no module imports another in a
circle. A failure names each offending import by file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("umbp", "transport", "metaserver")

# layer 0: sans-I/O wire and key modules and the shared leaves (errors, config, auth, buffer views, copies, ...)
LEAVES = {
    "transport.wire", "transport.answerrows", "transport.objformat", "transport.keyform", "transport.slotrules",
    "umbp", "umbp.errors", "umbp.sizes", "umbp.config", "umbp.auth", "umbp.caps", "umbp.quotarules",
    "umbp.admission", "umbp.tls", "umbp.metrics", "umbp.serving", "umbp.slotmap", "umbp.buffers", "umbp.copies",
    "umbp.devkernel",
}
# layer 3: engine helpers, the workload, and the supervisor of local pools it and ``umbp up`` start
ENGINE = ("umbp.engine", "umbp.integrations", "umbp.workload", "umbp.routing", "umbp.kvindex", "umbp.costmodel",
          "umbp.demo", "umbp.launcher")
TOP = ("umbp.cli", "umbp.__main__", "umbp.watch")
# (the package itself, a docstring, first)
INSIDE_METASERVER = ("metaserver", "metaserver.validate", "metaserver.table", "metaserver.store", "metaserver.handlers",
                     "metaserver.ha", "metaserver.server", "metaserver.__main__")
# the package's lazy ``umbp.Client``: the public entry point, resolved on first use (umbp/__init__.py)
ENTRY = {("umbp", "umbp.client")}


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def layer(name: str) -> int:
    """0 leaves, 1 transports, 2 the metaserver / the node and client, 3 engine helpers, the workload and the local
    pool supervisor, 4 the CLI."""
    if name in LEAVES:
        return 0
    if name.startswith("transport."):
        return 1
    if _under(name, TOP):
        return 4
    if _under(name, ENGINE):
        return 3
    return 2


def side(name: str) -> str:
    return "metaserver" if name.startswith("metaserver") else "pool"


def inner(name: str) -> int:
    """The place of a metaserver module's package in ``INSIDE_METASERVER`` (the most specific that holds it)."""
    return max(i for i, p in enumerate(INSIDE_METASERVER) if _under(name, (p,)))


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(mods: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(importer, imported module, line) for every import of a module in ``mods``, TYPE_CHECKING blocks left out."""
    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    out = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = {id(n) for node in ast.walk(tree)
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [resolve(f"{node.module}.{a.name}") or resolve(node.module) for a in node.names]
            else:
                continue
            out.extend((name, t, node.lineno) for t in targets if t and t != name)
    return out


def test_every_import_points_down_the_layers():
    mods = modules()
    assert {"transport.wire", "umbp.client", "metaserver.server", "umbp.node.server", "umbp.cli"} <= set(mods)
    edges = imports(mods)
    assert len(edges) > 400  # the scan saw the tree's imports, not an empty one
    bad = []
    for src, dst, line in edges:
        if (src, dst) in ENTRY:
            continue
        where = f"{mods[src].relative_to(ROOT)}:{line} imports {dst}"
        if layer(dst) > layer(src):
            bad.append(f"{where} (layer {layer(src)} -> {layer(dst)})")
        elif layer(src) == layer(dst) == 2 and side(src) != side(dst):
            bad.append(f"{where} (the metaserver and the node/client reach each other over the wire only)")
        elif src.startswith("metaserver") and dst.startswith("metaserver") and inner(dst) > inner(src):
            bad.append(f"{where} (inside the metaserver: {INSIDE_METASERVER[inner(src)]} may not import "
                       f"{INSIDE_METASERVER[inner(dst)]})")
    assert not bad, "imports that point up:\n" + "\n".join(bad)


def test_no_module_imports_another_in_a_circle():
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for src, dst, _ in imports(mods):
        if (src, dst) not in ENTRY:
            graph[src].add(dst)
    # Tarjan's strongly connected components, iteratively (no recursion limit to meet)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    circles.append(sorted(comp))
    assert not circles, f"modules importing each other in a circle: {circles}"


def test_the_checks_catch_an_upward_import_and_a_circle():
    """The rules themselves: a leaf importing the client, the metaserver importing the node, the table importing a
    handler are each up; a two-module loop is a circle."""
    assert layer("umbp.client") > layer("umbp.errors")
    assert layer("umbp.engine.gather") > layer("umbp.client") > layer("transport.tcp") > layer("transport.wire")
    assert layer("umbp.cli") > layer("umbp.workload.job")
    assert layer("umbp.node.server") == layer("metaserver.server") and side("umbp.node.server") != "metaserver"
    assert inner("metaserver.handlers.turns") > inner("metaserver.table.columns")
