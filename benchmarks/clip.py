"""CLIP / SigLIP benchmark (one GPU run): HF transformers eager vs our eager vs our CUDA-graph replay.

Default: CLIP ViT-L/14 at 224 px (`clip-vit-l-14`, random weights) in bf16, 1-image latency and
256-image throughput. Inputs are pixel tensors already on the GPU (no decoding or resizing, for HF
either); float32 matmuls stay full precision (TF32 off), as in the service. HF's
`CLIPVisionModelWithProjection` (or `SiglipVisionModel` for a SigLIP preset) runs eagerly with SDPA
attention and holds the same weights, so the run also reports how far its image embeddings are from
ours (both bf16). Prints a markdown table; `--json` writes the rows.

    python -m benchmarks.clip [--model clip-vit-l-14] [--images 1,256] [--backends triton,torch_varlen]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch

import encoder
import workspace
from benchmarks.common import matmul_peak, require_cuda, timed, use_backend, write_results
from benchmarks.flops import vit_flops_per_image as flops_per_image
from benchmarks.hf_vision import hf_pooled, hf_vision_model, to_patches
from encoder.attention import available_backends


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="clip-vit-l-14", help="a CLIP / SigLIP preset")
    parser.add_argument("--images", default="1,256", help="comma list of batch sizes (images per call)")
    parser.add_argument("--backends", default=None, help="comma list (default: the CUDA default backend)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    if not require_cuda("benchmarks.clip"):
        return 2
    peak = matmul_peak()
    base = encoder.load(args.model, device="cuda", dtype=torch.bfloat16)
    cfg = base.config
    per_image = flops_per_image(cfg)
    sizes = [int(x) for x in args.images.split(",")]
    names = args.backends.split(",") if args.backends else ["auto"]
    usable = available_backends()
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    pixels = {n: torch.randn(n, 3, cfg.image_size, cfg.image_size, device="cuda", generator=gen) for n in sizes}
    hf_pixels = {n: x.bfloat16() for n, x in pixels.items()}
    grids = {n: torch.tensor([[1, cfg.grid, cfg.grid]] * n) for n in sizes}
    batches = {n: encoder.PatchBatch(to_patches(pixels[n], cfg.patch_size), grids[n]) for n in sizes}

    def record(impl: str, n: int, ms: float, extra: dict | None = None) -> None:
        rows.append(dict(impl=impl, images=n, ms=ms, img_s=n / ms * 1e3, mfu=per_image * n / ms / 1e9 / peak,
                         **(extra or {})))  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)

    reference = None
    if not args.no_hf:
        hf = hf_vision_model(base)
        with torch.inference_mode():
            reference = hf_pooled(hf, {"pixel_values": hf_pixels[sizes[0]]}).float()
            for n in sizes:
                ms = timed(lambda n=n: hf_pooled(hf, {"pixel_values": hf_pixels[n]}), max(3, args.iters // 4))
                record("HF transformers eager (sdpa)", n, ms)
        del hf
        torch.cuda.empty_cache()

    def ours(name: str) -> None:
        enc = copy.copy(base)
        enc.model = copy.deepcopy(base.model)
        use_backend(enc, name)
        for n in sizes:
            record(f"ours eager ({name})", n, timed(lambda n=n: enc.run_packed(batches[n]), args.iters))
        t0 = time.perf_counter()
        graph = workspace.GraphEncoder(enc)  # 1, 2, 4, ..., 256 images; fuses q/k/v, pads the MLP
        setup = time.perf_counter() - t0
        stats = graph.stats()
        extra = {"capture_s": round(stats["capture_seconds"], 2), "setup_s": round(setup, 2),
                 "capture_gib": round(stats["capture_bytes"] / 2**30, 2), "buckets": len(graph.table)}  # fmt: skip
        for n in sizes:
            b = batches[n]
            run = lambda b=b: graph.runner.run_all(b.pixel_values, b.grid_thw)  # noqa: E731
            record(f"ours graph ({name})", n, timed(run, args.iters), extra)
            run = lambda b=b: graph.encode(b, "model")  # noqa: E731
            record(f"ours graph + host copy, model ({name})", n, timed(run, args.iters))
        if reference is not None:
            got = torch.stack(graph.encode(batches[sizes[0]], "model"))
            want = reference.cpu().double()
            err = ((got.double() - want).norm() / want.norm()).item()
            print(f"image embeddings, ours (graph, {name}) vs HF, both bf16: relative error {err:.2e}", flush=True)
            rows[-1]["rel_err_vs_hf"] = err

    for name in names:
        if name != "auto" and usable.get(name, "unknown backend") is not None:
            print(f"skipping backend {name}: {usable.get(name, 'unknown backend')}", file=sys.stderr)
            continue
        ours(name)
        torch.cuda.empty_cache()

    print(f"\n{args.model}, bf16, {torch.cuda.get_device_name()}; bf16 matmul peak measured: {peak:.0f} TFLOP/s; "
          f"{per_image / 1e9:.1f} GFLOP per image\n")  # fmt: skip
    print("| implementation | images | ms | images/s | MFU |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['impl']} | {r['images']} | {r['ms']:.2f} | {r['img_s']:.0f} | {r['mfu'] * 100:.1f}% |")
    write_results(args.json, {"model": args.model, "peak_tflops": peak, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
