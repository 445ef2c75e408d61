"""The architecture's rules, read from the source (ARCHITECTURE.md "Packages and rules"): no import cycles;
`encoder` imports nothing from `workspace` or `deployments`, `workspace` nothing from `deployments`; the ingress
and replica wings of `deployments` do not import each other and routing imports neither; no tower imports
another tower; nothing under `encoder/preprocessing/` or the ingress wing imports torch; Ray's private names
(`_` attributes of Ray objects, `_` keyword arguments, overridden `_` hooks) only in `deployments/ray_compat.py`."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("encoder", "workspace", "deployments")
RAY_COMPAT = "deployments.ray_compat"
TOWERS = (
    "encoder.models.qwen2",
    "encoder.models.qwen3",
    "encoder.models.vit",
    "encoder.models.text",
    "encoder.models.dinov2",
    "encoder.models.dinov3",
)
TORCH_FREE = ("encoder.preprocessing", "deployments.ingress.deployment")  # packages whose modules never import torch


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


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize(
    "wing, forbidden",
    [
        ("deployments.ingress.deployment", ("deployments.replica.deployment", "deployments.routing")),
        ("deployments.replica.deployment", ("deployments.ingress.deployment",)),
        ("deployments.routing", ("deployments.ingress.deployment", "deployments.replica.deployment")),
    ],
)
def test_the_wings_of_deployments_stay_apart(wing, forbidden):
    """The ingress (CPU) and the encoder replica (GPU) share only the modules at `deployments/`'s top; the router
    runs in every caller's process, so it carries neither wing."""
    wrong = {
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if _in(name, wing)
        for target in targets
        if any(_in(target, f) for f in forbidden)
    }
    assert not wrong, sorted(wrong)


def test_no_tower_imports_another_tower():
    """What towers share lives in `encoder/models/layers.py` (and the modules beside it), not in a sibling tower."""
    wrong = {f"{t} imports {u}" for t in TOWERS for u in GRAPH[t] if u in TOWERS and u != t}
    assert not wrong, sorted(wrong)


def imports_torch(tree: ast.Module) -> list[int]:
    """Lines of `tree` that import torch (or triton), at the top level or inside a function."""
    lines = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        if any(n.split(".")[0] in ("torch", "triton") for n in names):
            lines.append(node.lineno)
    return lines


def load_time(tree: ast.Module) -> ast.Module:
    """The imports of `tree` that run when it is imported: outside function bodies (in `if` / `try` too)."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            todo += [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
    return ast.Module(body=found, type_ignores=[])


def run_time(tree: ast.Module) -> ast.Module:
    """Every import of `tree` that can run (function bodies included), without `if TYPE_CHECKING:` blocks."""
    skip = {
        id(n)
        for i in ast.walk(tree)
        if isinstance(i, ast.If) and "TYPE_CHECKING" in ast.unparse(i.test)
        for n in i.body
    }
    return ast.Module(
        body=[n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in skip],
        type_ignores=[],
    )


def top_level_imports(name: str) -> set[str]:
    """The project modules `name` imports when it is imported (outside functions)."""
    return imported(name, load_time(TREES[name]))


def test_preprocessing_and_the_ingress_wing_import_no_torch():
    """Not even inside a function, and not through a project module they import at load time."""
    free = [n for n in MODULES if any(_in(n, p) for p in TORCH_FREE)]
    direct = {n: lines for n in free if (lines := imports_torch(run_time(TREES[n])))}
    assert not direct, direct
    reached, todo = set(), free + [t for n in free for t in imported(n, run_time(TREES[n]))]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += top_level_imports(name)
    body_torch = {n: lines for n in reached if (lines := imports_torch(load_time(TREES[n])))}
    assert not body_torch, body_torch


def test_the_rules_are_not_vacuous():
    """The checks above see what they look for: a tower importing torch, the graph linking the wings' modules."""
    assert imports_torch(TREES["encoder.models.qwen3"])
    assert "deployments.ingress.limits" in GRAPH["deployments.ingress.http_routes"]
    assert any(_in(t, "deployments.routing") for t in GRAPH["deployments.replica.deployment"])


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

    modules = [
        "deployments.ingress.deployment",
        "deployments.routing.router",
        "deployments.ingress.decode_pool",
        "deployments.batch.decode",
    ]
    # the drivers: building the app, the CLIs (they check the model before importing torch)
    modules += ["deployments.application", "encoder.__main__", "deployments.batch.job"]
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint(sorted(m for m in sys.modules if m == 'torch'))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", "torch imported by the ingress side"
