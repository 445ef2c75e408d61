"""Image-embedding towers against Hugging Face transformers (issue 46's GPU line: "image towers >= 3x HF eager at
1 image and >= 1.5x at 256 images"): HF eager vs our eager `VisionEncoder` vs our `workspace.GraphEncoder` replay,
in one process, the same random weights, bf16.

Default: SigLIP2 so400m/16 NaFlex (`siglip2-so400m-16-naflex`) at 256 and 1024 max patches, DINOv2-L
(`dinov2-large`) and DINOv3 ViT-L/16 (`dinov3-vitl16`), 1 and 256 images per call. HF runs its own model of the
family (`Siglip2VisionModel`, `Dinov2Model`, `DINOv3ViTModel`; `benchmarks/hf_vision.py` loads our weights into it as
a checkpoint), SDPA attention, eagerly. Inputs are already on the GPU, made as the processors make them, so nobody
pays for decoding or resizing:
  * NaFlex: images of several aspect ratios (`ASPECTS`, cycled), each at the patch grid transformers'
    `Siglip2ImageProcessor` gives it for `max_num_patches` (`naflex_size`), as pixel rows; HF gets them padded to
    `max_num_patches` per image with `pixel_attention_mask` and `spatial_shapes` (`hf_vision.naflex_inputs`), ours
    packed with no padding, the encoder's preprocessing set to that `max_num_patches` (its graph table follows);
  * DINOv2 / DINOv3: [N, 3, S, S] pixel tensors at the processor's crop (224 px), our patch rows cut from them.
Rows: ms per call (median, CUDA events; each measurement ~`--seconds` long), images/s, the speedup against HF, and
the relative error of the pooled output (SigLIP2's attention-pooling head, DINO's normed class token) against HF's
`pooler_output`, both bf16 (a parity check on the GPU). `ours, graph replay` is `GraphRunner.run_all` (outputs on
the GPU, as HF's); `+ host copy` is `GraphEncoder.encode` (float32 CPU vectors, what a caller gets). Float32
matmuls stay full precision (TF32 off), as in the service. A markdown table per model on stdout; `--json` writes
every row. `--device cpu` is a smoke run (tiny presets, float32, host clock, buckets run eagerly) that checks the
script before a GPU session (`tests/unit/test_benchmarks_towers.py`).

    python -m benchmarks.towers [--model siglip2-so400m-16-naflex,dinov2-large,dinov3-vitl16] [--max-patches 256,1024]
                                [--images 1,256] [--seconds 0.5] [--no-hf] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings

import torch

import encoder
import workspace
from benchmarks.common import require_cuda, timed, wall_timed, write_results
from benchmarks.hf_vision import hf_pooled, hf_vision_model, naflex_inputs, to_patches
from encoder.config import Siglip2VisionConfig
from encoder.preprocessing.naflex import NaflexPreprocessConfig, naflex_size

# issue 46: graph replay at least this many times as fast as HF eager, per images per call
TARGETS = {1: 3.0, 256: 1.5}
GPU_MODELS = "siglip2-so400m-16-naflex,dinov2-large,dinov3-vitl16"
CPU_MODELS = "tiny-siglip2,tiny-dinov2,tiny-dinov3"
# original (height, width) of the NaFlex images, cycled: 4:3 landscape first (the one-image rows), then portrait,
# square, 16:9 both ways, 3:1 panorama, 1:2, 2:3
ASPECTS = [(480, 640), (640, 480), (512, 512), (720, 1280), (1280, 720), (300, 900), (1000, 500), (600, 400)]


def naflex_grids(n: int, patch: int, max_patches: int) -> list[list[int]]:
    """Grids [1, h, w] of `n` images of the `ASPECTS` sizes as transformers' processor resizes them."""
    out = []
    for i in range(n):
        h, w = naflex_size(*ASPECTS[i % len(ASPECTS)], patch, max_patches)
        out.append([1, h // patch, w // patch])
    return out


class Case:
    """One model at one input setting (NaFlex: one `max_num_patches`): its encoder and, per image count, our
    `PatchBatch` (pixel rows on the device, grid on the host) and HF's inputs (on the device, in the model dtype)."""

    def __init__(self, base, max_patches: int | None, sizes: list[int], gen: torch.Generator):
        self.enc = copy.copy(base)  # the same tower; its own preprocessing (the graph table follows it)
        cfg, dev, dtype = base.config, base.device, base.dtype
        self.max_patches = max_patches
        self.batches, self.hf_inputs = {}, {}
        if isinstance(cfg, Siglip2VisionConfig):
            self.enc.preprocess_config = NaflexPreprocessConfig.for_model(cfg, max_num_patches=max_patches)
            for n in sizes:
                grid = torch.tensor(naflex_grids(n, cfg.patch_size, max_patches))
                rows = int(grid.prod(1).sum())
                pv = torch.rand(rows, cfg.patch_dim, device=dev, generator=gen) * 2 - 1  # normalised pixels
                pv = pv.to(dtype).float()  # values HF's bf16 input holds too: the errors are the towers' alone
                self.batches[n] = encoder.PatchBatch(pv, grid)
                self.hf_inputs[n] = naflex_inputs(self.batches[n], max_patches, dtype)
        else:
            s = cfg.image_size
            for n in sizes:
                pixels = torch.randn(n, 3, s, s, device=dev, generator=gen).to(dtype).float()
                grid = torch.tensor([[1, cfg.grid, cfg.grid]] * n)
                self.batches[n] = encoder.PatchBatch(to_patches(pixels, cfg.patch_size), grid)
                self.hf_inputs[n] = {"pixel_values": pixels.to(dtype)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


class Bench:
    """The run's settings, clock and rows (a model's rows are added by `run_model`)."""

    def __init__(self, args):
        self.args = args
        self.cuda = args.device == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.rows: list[dict] = []
        self.notes: list[str] = []

    def clock(self, fn) -> float:
        """Median ms per call of `fn`: about `--seconds` of calls (at most `--iters`; on CUDA 3 at least) after two
        warm-up calls (the first one also sizes the run); CUDA events on the GPU, the host clock on the CPU."""
        sync = torch.cuda.synchronize if self.cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        once = time.perf_counter() - t0
        iters = max(3 if self.cuda else 1, min(self.args.iters, int(self.args.seconds / max(once, 1e-6))))
        return timed(fn, iters, warmup=1) if self.cuda else wall_timed(fn, iters)

    def record(self, name: str, case: Case, impl: str, n: int, ms: float, **extra) -> dict:
        real = int(case.batches[n].grid_thw.prod(1).sum())
        row = dict(model=name, max_patches=case.max_patches, impl=impl, images=n, patches=real, ms=ms,
                   img_s=n / ms * 1e3, **extra)  # fmt: skip
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    def free(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()


def run_model(bench: Bench, name: str, max_patches: list[int], sizes: list[int]) -> list[dict]:
    """HF eager, our eager encoder, then our graphs (one `GraphEncoder` per NaFlex max_num_patches) for preset
    `name`; its rows. Models and graphs are built as the service builds them (outside inference mode); every
    forward runs in inference mode."""
    args, cuda = bench.args, bench.cuda
    first = len(bench.rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", encoder.RandomWeightsWarning)
        base = encoder.load(name, device=args.device, dtype=bench.dtype)
    naflex = isinstance(base.config, Siglip2VisionConfig)
    gen = torch.Generator(device=args.device).manual_seed(0)
    cases = [Case(base, m, sizes, gen) for m in (max_patches if naflex else [None])]
    hf_out: dict[tuple[int | None, int], torch.Tensor] = {}
    # HF first (its weights read from the unfused tower), then freed
    if not args.no_hf:
        t0 = time.perf_counter()
        hf = hf_vision_model(base)
        bench.notes.append(f"{name}: HF {type(hf).__name__} built and loaded in {time.perf_counter() - t0:.1f} s")
        with torch.inference_mode():
            for case in cases:
                for n in sizes:
                    inputs = case.hf_inputs[n]
                    hf_out[case.max_patches, n] = hf_pooled(hf, inputs).float()
                    ms = bench.clock(lambda i=inputs: hf_pooled(hf, i))
                    bench.record(name, case, "HF transformers eager (sdpa)", n, ms)
        del hf
        bench.free()

    def versus_hf(case: Case, n: int, pooled: torch.Tensor) -> dict:
        ref = hf_out.get((case.max_patches, n))
        return {} if ref is None else {"rel_err_vs_hf": rel_err(pooled.float(), ref)}

    # our eager encoder (unfused, as `encoder.load` gives it), before a GraphEncoder fuses the shared tower
    with torch.inference_mode():
        for case in cases:
            for n in sizes:
                b, enc = case.batches[n], case.enc
                err = versus_hf(case, n, enc.run_packed(b).pooled)
                bench.record(name, case, "ours, eager", n, bench.clock(lambda b=b, e=enc: e.run_packed(b)), **err)
    for case in cases:
        t0 = time.perf_counter()
        graph = workspace.GraphEncoder(case.enc, None if cuda else "256,1024")
        setup_s = time.perf_counter() - t0
        stats = graph.runner.stats
        bench.notes.append(
            f"{name}" + (f" at {case.max_patches} max patches" if naflex else "") + f": {stats.captures} graphs "
            f"({', '.join(f'{k.budget}/{k.max_images}' for k in graph.table.keys)} patches/images) captured in "
            f"{stats.capture_seconds:.1f} s, {stats.capture_bytes / 2**30:.2f} GiB of pool; set up in {setup_s:.1f} s"
        )
        measure_graph(bench, name, case, graph, sizes, versus_hf)
        del graph
        bench.free()
    return bench.rows[first:]


@torch.inference_mode()
def measure_graph(bench: Bench, name: str, case: Case, graph, sizes: list[int], versus_hf) -> None:
    """`graph`'s rows: `run_all` (outputs on the device) and `encode` (float32 vectors on the host), with what one
    call ran (replays, packs run eagerly at their exact size, padding rows) and the errors against HF."""
    runner, stats = graph.runner, graph.runner.stats
    impl = "ours, graph replay" if runner.use_graphs else "ours, buckets run eagerly (no CUDA)"
    for n in sizes:
        b = case.batches[n]
        before = stats.as_dict()
        pooled = runner.run_all(b.pixel_values, b.grid_thw).pooled
        after = stats.as_dict()
        packs = {
            "replays": sum(after["replays"].values()) - sum(before["replays"].values()),
            "eager_packs": after["eager_runs"] - before["eager_runs"],
            "padded_patches": after["padded_patches"] - before["padded_patches"],
        }
        ms = bench.clock(lambda b=b: runner.run_all(b.pixel_values, b.grid_thw))
        bench.record(name, case, impl, n, ms, **versus_hf(case, n, pooled), **packs)
        host = torch.stack(graph.encode(b, "model"))
        ms = bench.clock(lambda b=b: graph.encode(b, "model"))
        bench.record(name, case, f"{impl} + host copy", n, ms, **versus_hf(case, n, host))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help=f"comma list of presets (default: {GPU_MODELS}; cpu: "
                        f"{CPU_MODELS})")  # fmt: skip
    parser.add_argument("--max-patches", default=None, help="NaFlex max_num_patches, comma list (default: 256,1024; "
                        "cpu: 16,64)")  # fmt: skip
    parser.add_argument("--images", default=None, help="comma list of images per call (default: 1,256; cpu: 1,3)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run")
    parser.add_argument("--seconds", type=float, default=0.5, help="about how long each measurement runs")
    parser.add_argument("--iters", type=int, default=30, help="at most this many timed calls per measurement")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--json", default=None, help="also write the rows here (rewritten after each model)")
    args = parser.parse_args(argv)
    bench = Bench(args)
    if bench.cuda and not require_cuda("benchmarks.towers"):
        return 2
    models = (args.model or (GPU_MODELS if bench.cuda else CPU_MODELS)).split(",")
    max_patches = [int(x) for x in (args.max_patches or ("256,1024" if bench.cuda else "16,64")).split(",")]
    sizes = [int(x) for x in (args.images or ("1,256" if bench.cuda else "1,3")).split(",")]
    device_name = torch.cuda.get_device_name() if bench.cuda else "CPU"
    for name in models:
        rows = run_model(bench, name, max_patches, sizes)
        bench.free()
        print_table(name, rows, device_name, bench.dtype)
        print_acceptance(rows)  # per model as it ends (a step cut short keeps the models done), then all of them
        write_results(args.json, {"models": models, "dtype": str(bench.dtype), "notes": bench.notes,
                                  "rows": bench.rows})  # fmt: skip
    print_acceptance(bench.rows)
    print("\n" + "\n".join(bench.notes))
    return 0


def print_acceptance(rows: list[dict]) -> None:
    """Issue 46's line per model and setting: graph replay's speedup over HF eager against `TARGETS`, and the
    largest relative error of our pooled outputs (eager and graph) against HF's."""
    hf = {(r["model"], r["max_patches"], r["images"]): r["ms"] for r in rows if r["impl"].startswith("HF")}
    graph = {(r["model"], r["max_patches"], r["images"]): r["ms"] for r in rows if r.get("replays") is not None}
    sizes = sorted({k[2] for k in hf} & set(TARGETS))
    if not sizes:
        return
    print("\nissue 46: graph replay (outputs on the GPU) against HF eager, same weights and inputs\n")
    head = [f"{n} image{'s' if n > 1 else ''} (>= {TARGETS[n]:g}x)" for n in sizes]
    print("| model | max patches | " + " | ".join(head) + " | max rel. error vs HF |")
    print("| --- | ---: | " + " | ".join("---:" for _ in sizes) + " | ---: |")
    for model, mp in dict.fromkeys((k[0], k[1]) for k in hf):
        cells = []
        for n in sizes:
            ref, ours = hf.get((model, mp, n)), graph.get((model, mp, n))
            if ref is None or ours is None:
                cells.append("-")
                continue
            x = ref / ours
            cells.append(f"{x:.2f}x {'pass' if x >= TARGETS[n] else 'FAIL'}")
        mine = [r for r in rows if (r["model"], r["max_patches"]) == (model, mp)]
        errs = [r["rel_err_vs_hf"] for r in mine if "rel_err_vs_hf" in r]
        err = f"{max(errs):.1e}" if errs else "-"
        print(f"| {model} | {'-' if mp is None else mp} | " + " | ".join(cells) + f" | {err} |")


def print_table(name: str, rows: list[dict], device_name: str, dtype: torch.dtype) -> None:
    hf_ms = {(r["max_patches"], r["images"]): r["ms"] for r in rows if r["impl"].startswith("HF")}
    print(f"\n{name}, {str(dtype).removeprefix('torch.')}, {device_name}\n")
    print("| implementation | max patches | images | real patches | ms | images/s | vs HF | rel. error vs HF |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        ref = hf_ms.get((r["max_patches"], r["images"]))
        speedup = f"{ref / r['ms']:.2f}x" if ref else "-"
        err = f"{r['rel_err_vs_hf']:.1e}" if "rel_err_vs_hf" in r else "-"
        mp = "-" if r["max_patches"] is None else r["max_patches"]
        print(f"| {r['impl']} | {mp} | {r['images']} | {r['patches']} | {r['ms']:.2f} | {r['img_s']:.0f} | "
              f"{speedup} | {err} |")  # fmt: skip
    print(flush=True)


if __name__ == "__main__":
    sys.exit(main())
