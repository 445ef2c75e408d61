"""The package rules, read from the source (ARCHITECTURE.md "Rules"): no import cycles; `encoder` imports
nothing from `workspace` or `deployments`, `workspace` nothing from `deployments`; no module over 400 lines;
Ray's private names (`_` attributes of Ray objects, `_` keyword arguments, overridden `_` hooks) only in
`deployments/ray_compat.py`."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("encoder", "workspace", "deployments")
RAY_COMPAT = "deployments.ray_compat"
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def imported(name: str, tree: ast.Module) -> set[str]:
    """The project modules `name` imports, anywhere in it (top level or inside functions)."""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `from pkg.mod import name`: the module pkg.mod
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: imported(name, tree) for name, tree in TREES.items()}


def test_the_import_graph_has_no_cycles():
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            visit(node)


@pytest.mark.parametrize(
    "package, forbidden", [("encoder", ("workspace", "deployments")), ("workspace", ("deployments",))]
)
def test_lower_packages_import_nothing_from_higher_ones(package, forbidden):
    wrong = {
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if name.split(".")[0] == package
        for target in targets
        if target.split(".")[0] in forbidden
    }
    assert not wrong, sorted(wrong)


def test_no_module_is_over_400_lines():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def _private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def ray_private_uses(tree: ast.Module) -> list[str]:
    """Where a module uses a private Ray name: `from ray._x import`, `import_from_ray._y`, `ray_name._y`,
    a `_keyword=` argument, or a `_method` / `self._attr` of a Ray base class it subclasses."""
    uses, ray_names, ray_bases = [], set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ray":
            if any(_private(part) for part in node.module.split(".")):
                uses.append(f"line {node.lineno}: from {node.module} import")
            for alias in node.names:
                if _private(alias.name):
                    uses.append(f"line {node.lineno}: imports {alias.name}")
                ray_names.add(alias.asname or alias.name)
                obj = getattr(importlib.import_module(node.module), alias.name, None)
                if inspect.isclass(obj):
                    ray_bases[alias.asname or alias.name] = obj
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "ray":
                    ray_names.add((alias.asname or alias.name).split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in ray_names:
                uses.append(f"line {node.lineno}: {root.id}....{node.attr}")
        elif isinstance(node, ast.Call):
            uses += [f"line {node.lineno}: {kw.arg}=" for kw in node.keywords if kw.arg and _private(kw.arg)]
        elif isinstance(node, ast.ClassDef):
            bases = [ray_bases[b.id] for b in node.bases if isinstance(b, ast.Name) and b.id in ray_bases]
            if not bases:
                continue
            inherited = set()
            for base in bases:
                for klass in base.__mro__:
                    inherited |= set(vars(klass))
                    init = vars(klass).get("__init__")
                    inherited |= set(getattr(getattr(init, "__code__", None), "co_names", ()))
            own = {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
            assigned = {
                t.attr
                for n in ast.walk(node)
                for t in (n.targets if isinstance(n, ast.Assign) else [getattr(n, "target", None)])
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
            }
            uses += [f"{node.name} overrides {m}" for m in own if _private(m) and m in inherited]
            uses += [
                f"line {n.lineno}: self.{n.attr} of a Ray base"
                for n in ast.walk(node)
                if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name)
                and n.value.id == "self"
                and _private(n.attr)
                and n.attr in inherited - assigned - own
            ]
    return uses


def test_ray_private_names_are_used_in_ray_compat_only():
    found = {name: uses for name, tree in TREES.items() if name != RAY_COMPAT and (uses := ray_private_uses(tree))}
    assert not found, found


def test_the_check_sees_what_ray_compat_does():
    """The rule is not vacuous: ray_compat's own private uses are all found."""
    uses = "\n".join(ray_private_uses(TREES[RAY_COMPAT]))
    for name in ("_get_serve_request_context", "_serve_request_context", "_by_reference=", "_RequestContext"):
        assert name in uses, (name, uses)


def test_the_ingress_side_imports_no_torch():
    """Ingress replicas, their decode workers and the handle routers decode, check and route images; importing
    torch there cost ~2.7 s of CPU and ~200 MB per process (twice per ingress replica: itself and its decode
    pool's forkserver). The application module (what a driver imports to build the app: `serve run`, the
    launcher) imports the encoder replica's class, whose torch side loads in its constructor. A fresh
    interpreter imports those modules and must not have loaded torch."""
    import subprocess
    import sys

    modules = ["deployments.ingress", "deployments.router", "encoder.decode_pool", "deployments.batch.decode"]
    # the drivers: building the app, the CLIs (they check the model before importing torch)
    modules += ["deployments.application", "encoder.__main__", "deployments.batch.job"]
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint(sorted(m for m in sys.modules if m == 'torch'))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", "torch imported by the ingress side"
