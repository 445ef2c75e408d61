"""Every script in benchmarks/ (and benchmarks/experiments/) imports and answers `--help`, and every command line
`benchmarks/device_run.sh` runs parses, on a CPU: a script broken by a renamed function or argument fails here, not
in a GPU session's scarce minutes. In this process (torch is loaded already): runpy runs each module as
`python -m benchmarks.<name>` would. Running them is left to the GPU (`benchmarks/device_run.sh`)."""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for p in [*BENCH.glob("*.py"), *BENCH.glob("experiments/*.py")]
    if p.name != "__init__.py"
)
# no command line to ask: imported only (their `__main__` would run the benchmark or the sampler)
NO_CLI = {
    "benchmarks.common": "what the benchmarks share",
    "benchmarks.flops": "the FLOP counting the benchmarks import",
    "benchmarks.hf_vision": "HF transformers' twins of our image towers, which clip.py and towers.py import",
    "benchmarks.load_gen": "service.py's load generator",
    "benchmarks.experiments.suite_cpu": "a pytest plugin",
    "benchmarks.experiments.suite_procs": "a pytest plugin; its __main__ is the sampler process (two paths)",
}
DEVICE_RUN = (BENCH / "device_run.sh").read_text()
# device_run.sh's shell variables, filled in as a run would fill them
SHELL_VALUES = {
    '${depth:+--pipeline-depth "$depth"}': "--pipeline-depth 2",
    "${SVC_EXTRA:-}": "--gil-switch-interval 0.005",
    '"$model"': "qwen2.5-vl-7b",
    '"$r"': "2",
    '"$slots"': "1",
    "$m": "qwen3-vl-8b",
    "$q": "--quantization fp8 --fp8-fast-accum",
    '${PHOTOS:+--images "$PHOTOS"}': "--images /tmp/photos",
}


def device_run_commands() -> list[str]:
    """Every `python3 -m benchmarks....` command line of device_run.sh, its variables filled in (`$extra`: once per
    value the script gives it), up to its first redirection."""
    code = "\n".join(line for line in DEVICE_RUN.splitlines() if not line.lstrip().startswith("#"))
    text = code.replace("\\\n", " ")
    extras = re.findall(r'extra="([^"]*)"', text)
    commands = []
    for match in re.finditer(r"python3 -m (benchmarks[\w.]*)([^>\n;|]*)", text):
        line = match.group(1) + match.group(2)
        line = re.sub(r'"\$OUT/([^"]*)"', r"/tmp/out/\1", line)
        for var, value in SHELL_VALUES.items():
            line = line.replace(var, value)
        commands += [line.replace("$extra", e) for e in extras] if "$extra" in line else [line]
    return [" ".join(c.split()) for c in commands]


class Parsed(Exception):
    pass


@pytest.fixture
def run_module(monkeypatch):
    """Run `module` as `__main__` with `args` (as `python -m module args`); benchmark modules it imported are
    dropped afterwards."""
    before = set(sys.modules)

    def run(module: str, args: list[str], main: bool = True) -> None:
        monkeypatch.setattr(sys, "argv", [module, *args])
        sys.modules.pop(module, None)  # run_module warns when the module it runs is imported already
        runpy.run_module(module, run_name="__main__" if main else "benchmark_import", alter_sys=True)

    yield run
    for mod in set(sys.modules) - before:
        if mod.startswith("benchmarks"):
            del sys.modules[mod]


@pytest.mark.parametrize("module", MODULES)
def test_every_benchmark_imports_and_answers_help(module, run_module, capsys):
    if module in NO_CLI:
        run_module(module, [], main=False)
        return
    with pytest.raises(SystemExit) as exit_:
        run_module(module, ["--help"])
    assert exit_.value.code in (0, None), capsys.readouterr().err
    assert "usage:" in capsys.readouterr().out


def test_the_experiments_say_what_they_answered():
    """benchmarks/experiments/ holds questions already asked: each docstring ends with its answer."""
    import ast

    for path in sorted((BENCH / "experiments").glob("*.py")):
        if path.name == "__init__.py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        last = doc.strip().split("\n\n")[-1]
        assert last.startswith("Answer ("), f"{path.name}: its docstring does not end with its answer"


def test_no_benchmark_edits_sys_path():
    """Scripts import each other as the `benchmarks` package does, never through sys.path."""
    offenders = [
        str(p.relative_to(ROOT)) for p in BENCH.rglob("*.py") if re.search(r"sys\.path\.(insert|append)", p.read_text())
    ]
    assert not offenders


@pytest.mark.parametrize("command", device_run_commands(), ids=lambda c: " ".join(c.split()[:6]))
def test_the_device_runs_arguments_parse(command, run_module, monkeypatch):
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *args, **kwargs):
        raise Parsed(parse(self, *args, **kwargs))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    module, *args = shlex.split(command)
    assert module in MODULES, f"device_run.sh runs {module}, which is gone"
    with pytest.raises(Parsed):
        run_module(module, args)


def test_device_run_sh_runs_every_product_benchmark_and_its_other_calls_resolve():
    ran = {shlex.split(c)[0] for c in device_run_commands()}
    for module in ("benchmarks.engine", "benchmarks.clip", "benchmarks.startup", "benchmarks.attention"):
        assert module in ran, module
    assert len(device_run_commands()) >= 12
    from benchmarks.batch import export_preset  # the `ckpt` step's `python3 -c`

    assert callable(export_preset)
    assert "from benchmarks.batch import export_preset" in DEVICE_RUN


def test_the_wheel_leaves_the_benchmarks_out():
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not [p for p in include if "benchmarks".startswith(p.rstrip("*"))], include


@pytest.mark.parametrize("preset", ["tiny-qwen2-vl", "tiny", "tiny-qwen3-vl"])
def test_engine_builds_the_hf_tower_of_every_qwen_family(preset):
    """engine.py's HF-eager rows: the transformers tower of the model's own family, holding our weights. It built a
    Qwen2.5-VL tower for Qwen2-VL models too and failed there (no `fullatt_block_indexes`)."""
    import torch

    import encoder
    from benchmarks.engine import hf_tower
    from tests.graph_cases import rel_err

    enc = encoder.load(preset, device="cpu", dtype=torch.float32)
    grid = torch.tensor([[1, 8, 12]])
    pixels = torch.randn(96, enc.config.patch_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf_tower(enc, "cpu")(pixels, grid_thw=grid)
    ref = getattr(ref, "pooler_output", ref)
    assert rel_err(enc.encode(encoder.PatchBatch(pixels, grid), pooling="none")[0], ref) <= 1e-5
