"""The import graph of specdecode has no circles and points one way (low layers never import high ones).

Read from the source with `ast`, not by importing: every `import` / `from ... import` counts,
at module level, inside functions, and under `if TYPE_CHECKING:` alike. `from .pkg import name`
is an edge to `pkg.name` when that is a module, else to `pkg`. Importing `a.b.c` from outside
package `a.b` also runs `a/b/__init__.py`, so that is an edge too (the root package's lazy
`__getattr__` re-export excepted: nothing imports the root package itself).
"""
from __future__ import annotations

import ast
from pathlib import Path

import specdecode

ROOT = Path(specdecode.__file__).resolve().parent
# subpackages / modules below the interfaces: they must never import the layers above them
LOW = ("params", "sampling", "structured", "verify", "cache", "tokenizer", "datasets", "models", "fast", "drafters",
       "engine")
HIGH = ("api", "cli", "serve", "bench", "distill", "info")


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ["specdecode", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def is_package(name: str, mods: dict[str, Path]) -> bool:
    return mods[name].name == "__init__.py"


def imports_of(name: str, mods: dict[str, Path]) -> set[str]:
    tree = ast.parse(mods[name].read_text(), str(mods[name]))
    package = name if is_package(name, mods) else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                targets.add(sub if sub in mods else module)
    edges = set()
    for target in targets:
        while target and target not in mods:          # `import specdecode.x.y` of a name inside y
            target = target.rpartition(".")[0]
        if not target or target == name:
            continue
        edges.add(target)
        parent = target.rpartition(".")[0]
        while parent.count("."):                       # parent packages below the root run too
            if parent in mods and not (name + ".").startswith(parent + "."):
                edges.add(parent)
            parent = parent.rpartition(".")[0]
    return edges


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, mods) for name in mods}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (iterative DFS with colours)."""
    state: dict[str, int] = {}          # 1 on the stack, 2 done
    for start in sorted(edges):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(edges[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(edges.get(child, ())))))
    return None


def layer(name: str, names: tuple[str, ...]) -> bool:
    rest = name.removeprefix("specdecode.")
    return any(rest == n or rest.startswith(n + ".") for n in names)


def test_the_walker_sees_function_level_and_relative_imports():
    g = graph()
    assert "specdecode.engine.offline" in g["specdecode.api"]                 # module level
    assert "specdecode.api" in g["specdecode.cli"]                            # inside cmd_generate
    assert "specdecode.drafters.registry" in g["specdecode.cli_common"]       # inside a function
    assert "specdecode.datasets" in g["specdecode.bench.workload"]            # `from .. import datasets`
    assert "specdecode.bench" in g["specdecode.cli"]                          # the package's __init__ runs
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_low_layers_never_import_high_ones():
    bad = [f"{name} -> {target}" for name, targets in graph().items() if layer(name, LOW)
           for target in targets if layer(target, HIGH)]
    assert not bad, "low layers import high ones: " + "; ".join(sorted(bad))


def assigned_self_attributes(function: ast.AST) -> set[str]:
    return {node.attr for node in ast.walk(function)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name) and node.value.id == "self"}


def test_engine_serve_and_drafters_create_attributes_only_in_init():
    """A class's instance attributes are all created in its __init__ (or declared on the class, or
    created in the __init__ of a base class of these layers): no state appears on an object between
    two calls, and nothing writes another object's fields."""
    classes = {}                            # class name -> (its node, attributes its __init__ creates)
    for name, path in modules().items():
        if layer(name, ("engine", "serve", "drafters")):
            for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
                init = next((m for m in cls.body if isinstance(m, ast.FunctionDef) and m.name == "__init__"), None)
                classes[(name, cls.name)] = (cls, assigned_self_attributes(init) if init is not None else set())
    by_name = {cls_name: entry for (_, cls_name), entry in classes.items()}

    def inherited(cls: ast.ClassDef, seen: frozenset = frozenset()) -> set[str]:
        out = set()
        for base in cls.bases:
            base_name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
            if base_name in by_name and base_name not in seen:
                base_cls, base_created = by_name[base_name]
                out |= base_created | inherited(base_cls, seen | {base_name})
        return out

    bad = []
    for (name, _), (cls, created) in classes.items():
        methods = [n for n in cls.body if isinstance(n, ast.FunctionDef)]
        declared = {t.id for n in cls.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        declared |= {m.name for m in methods}           # properties
        known = created | declared | inherited(cls)
        for method in methods:
            if method.name == "__init__":
                continue
            for attr in sorted(assigned_self_attributes(method) - known):
                bad.append(f"{name}.{cls.name}.{method.name} creates self.{attr}")
    assert not bad, "attributes created outside __init__: " + "; ".join(bad)


def test_nothing_writes_another_objects_private_fields():
    bad = [f"{name}:{node.lineno} writes .{node.attr}" for name, path in modules().items()
           for node in ast.walk(ast.parse(path.read_text()))
           if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr.startswith("_")
           and not node.attr.startswith("__") and not (isinstance(node.value, ast.Name) and node.value.id == "self")]
    assert not bad, "; ".join(bad)
