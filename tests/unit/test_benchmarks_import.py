"""Every script in benchmarks/ imports and answers `--help`, and the invocations `benchmarks/device_run.sh` makes
parse, on a CPU: a script broken by a renamed function or argument fails here, not in a GPU session's scarce
minutes. In this process (torch is loaded already): runpy runs each script as `python benchmarks/x.py` would,
its directory first on sys.path. Running them is left to the CPU smoke commands (docs/performance.md) and the GPU."""

from __future__ import annotations

import argparse
import re
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))
# no command line to ask: imported only (their `__main__` would run the benchmark or the sampler)
NO_CLI = {
    "cuda_timing.py": "timers the others import",
    "load_gen.py": "service.py's load generator",
    "suite_cpu.py": "a pytest plugin",
    "suite_procs.py": "a pytest plugin; its __main__ is the sampler process, started with two paths",
}
# as benchmarks/device_run.sh runs them (its variables filled in)
DEVICE_RUN = [
    "attention.py --check",
    "engine.py --json /tmp/engine.json",
    "engine.py --model qwen3-vl-8b --pad-compare --json /tmp/engine_qwen3.json",
    "engine.py --backends triton --json /tmp/engine_q25.json",
    "engine.py --backends triton --no-hf",
    "profile_engine.py",
    "clip.py",
    "batch.py --as-checkpoint --num-images 20000 --markdown /tmp/batch.md",
    "service.py --model /tmp/ckpt-7b --replicas-per-gpu 2 --ingress-slots 1 --pipeline-depth 2"
    " --gil-switch-interval 0.005 --ingress-replicas 6 --client-procs 4 --duration 6 --json /tmp/svc.json",
    "service.py --model qwen2.5-vl-7b --replicas-per-gpu 1 --router-compare --ingress-replicas 6 --client-procs 4"
    " --duration 6 --json /tmp/acceptance.json",
    "service.py --model qwen2.5-vl-7b --replicas-per-gpu 2 --serve-mode default --ingress-replicas 6"
    " --client-procs 4 --duration 6 --json /tmp/servicedefault.json",
]


class Parsed(Exception):
    pass


@pytest.fixture
def run_script(monkeypatch):
    """Run benchmarks/<name> as `__main__` with `args`; sibling modules it imports are dropped afterwards."""
    before = set(sys.modules)

    def run(name: str, args: list[str], main: bool = True) -> None:
        monkeypatch.setattr(sys, "path", [str(BENCH), str(ROOT), str(ROOT / "tests"), *sys.path])
        monkeypatch.setattr(sys, "argv", [str(BENCH / name), *args])
        runpy.run_path(str(BENCH / name), run_name="__main__" if main else "benchmark_import")

    yield run
    for mod in set(sys.modules) - before:
        if str(BENCH) in str(getattr(sys.modules[mod], "__file__", None) or ""):
            del sys.modules[mod]


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_benchmark_imports_and_answers_help(name, run_script, capsys):
    if name in NO_CLI:
        run_script(name, [], main=False)
        return
    with pytest.raises(SystemExit) as exit_:
        run_script(name, ["--help"])
    assert exit_.value.code in (0, None), capsys.readouterr().err
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("command", DEVICE_RUN, ids=lambda c: " ".join(c.split()[:6]))
def test_the_device_runs_arguments_parse(command, run_script, monkeypatch):
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *args, **kwargs):
        raise Parsed(parse(self, *args, **kwargs))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    name, *args = command.split()
    with pytest.raises(Parsed):
        run_script(name, args)


def test_the_device_run_list_covers_every_script_device_run_sh_runs():
    ran = set(re.findall(r"benchmarks/(\w+\.py)", (BENCH / "device_run.sh").read_text()))
    assert ran <= set(SCRIPTS), f"device_run.sh runs scripts that are gone: {sorted(ran - set(SCRIPTS))}"
    assert ran <= {c.split()[0] for c in DEVICE_RUN}


@pytest.mark.parametrize("preset", ["tiny-qwen2-vl", "tiny", "tiny-qwen3-vl"])
def test_engine_builds_the_hf_tower_of_every_qwen_family(preset, monkeypatch):
    """engine.py's HF-eager rows: the transformers tower of the model's own family, holding our weights. It built a
    Qwen2.5-VL tower for Qwen2-VL models too and failed there (no `fullatt_block_indexes`)."""
    import torch

    import encoder
    from tests.graph_cases import rel_err

    monkeypatch.setattr(sys, "path", [str(BENCH), str(ROOT), *sys.path])
    hf_tower = runpy.run_path(str(BENCH / "engine.py"), run_name="benchmark_import")["hf_tower"]
    enc = encoder.load(preset, device="cpu", dtype=torch.float32)
    grid = torch.tensor([[1, 8, 12]])
    pixels = torch.randn(96, enc.config.patch_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf_tower(enc, "cpu")(pixels, grid_thw=grid)
    ref = getattr(ref, "pooler_output", ref)
    assert rel_err(enc.encode(encoder.PatchBatch(pixels, grid), pooling="none")[0], ref) <= 1e-5
