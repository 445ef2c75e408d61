"""What the examples need is what the README's first command installs, and no example joins a Ray cluster it
was not told about (read from the source; `tests/integration/serve/test_examples.py` and `test_examples_local.py` run
them)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
OURS = {"encoder", "workspace", "deployments"}
DISTRIBUTIONS = {"PIL": "pillow"}  # import name -> distribution name where they differ
# llm_handoff.py runs a Hugging Face VLM next to our encoder; its docstring says to install transformers
EXTRA = {"llm_handoff.py": {"transformers"}}


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - OURS - {"__future__"}


def main_dependencies() -> set[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[\[<>=!~; ]", d, maxsplit=1)[0].lower().replace("-", "_") for d in deps}


def test_every_example_import_is_a_main_dependency():
    assert EXAMPLES
    deps = main_dependencies()
    for path in EXAMPLES:
        needed = {DISTRIBUTIONS.get(n, n).lower() for n in imports(path)} - EXTRA.get(path.name, set())
        assert needed <= deps, f"{path.name} imports {sorted(needed - deps)}, not installed by `pip install -e .`"


def test_llm_handoff_says_what_it_needs():
    assert "pip install" in (ROOT / "examples" / "llm_handoff.py").read_text().split('"""')[1]


def test_no_example_joins_a_cluster_by_default():
    for path in [*EXAMPLES, *(ROOT / "examples").glob("*.sh")]:
        text = path.read_text()
        assert "--address auto" not in text and 'address="auto"' not in text, path.name
        tree = ast.parse(text) if path.suffix == ".py" else None
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "init":
                address = {k.arg: k.value for k in node.keywords}.get("address")
                assert address is not None, f"{path.name}: ray.init() without an address joins any local cluster"


def test_one_application_name_and_the_committed_config_binds_this_machine_only():
    """Broken: serve_config.yaml named the application `vision` and bound 0.0.0.0, while `serve run
    deployments:app`, the launcher, the README's handle snippet and handle_pipeline.py use `default`."""
    import yaml

    from deployments.__main__ import parse_args
    from deployments.config import DEFAULT_APP_NAME
    from deployments.launch_config import resolve

    assert DEFAULT_APP_NAME == "default"  # the name Serve gives an application run without one (`serve run ...:app`)
    assert resolve(parse_args([])).name == DEFAULT_APP_NAME
    for name in ("serve_config.yaml", "serve_production.yaml"):
        config = yaml.safe_load((ROOT / "deployments" / name).read_text())
        assert [app["name"] for app in config["applications"]] == [DEFAULT_APP_NAME], name
    assert yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())["http_options"]["host"] == (
        "127.0.0.1"
    )
    assert f'--app", default="{DEFAULT_APP_NAME}"' in (ROOT / "examples" / "handle_pipeline.py").read_text()
    assert f'serve.get_app_handle("{DEFAULT_APP_NAME}")' in (ROOT / "README.md").read_text()
