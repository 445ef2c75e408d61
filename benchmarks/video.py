"""Video benchmark (issue 47's line: "a 448×448, 64-frame video through graphs vs HF eager `get_video_features` in
the same process (≥ 3×)"): one video through the Qwen towers, bf16, random weights (the preset's published config).

The video is 64 uint8 frames of 448×448 at 2 fps, made here (smooth moving colour fields, no PyAV needed),
preprocessed by `VisionEncoder.preprocess_video` as the checkpoint's transformers video processor would (all 64
frames sampled at 2 fps) and timed apart. The towers then run the video at its full size (Qwen2.5-VL: 32 temporal
patches of 32×32 = 32,768 patches; Qwen3-VL: 32 of 28×28 = 25,088), the processor's pixels where its grid is that
(Qwen2.5-VL's defaults), else random pixel rows of that grid (Qwen3-VL's class defaults cap a video's total pixels
and would shrink the frames to 6×6 patches). Rows, per model, all on the same pixel values:

  HF transformers eager (sdpa)  the HF vision tower holding our weights, called as `get_video_features` calls it
                                (`visual(pixel_values_videos, grid_thw=video_grid_thw)`), output on the device.
  ours eager                    `VisionEncoder.run_packed` (the whole video in one pass).
  ours graph                    `GraphEncoder.runner.run_all`: frames packed into the bucket graphs, output on
                                the device (what HF's row measures).
  ours graph + host copy        `GraphEncoder.encode_llm(batch, torch.bfloat16)`: the LLM-ready outputs on the host.

Each row's tokens are checked against HF's (relative error, bf16 noise) and the speed-up over HF is printed.
Preprocessing (CPU) is timed once and shown apart. `--device cpu` is a smoke run on a tiny preset (no HF, no
graphs: the same packing eagerly, host clock; HF in float32).

    python -m benchmarks.video [--models qwen3-vl-8b,qwen2.5-vl-7b] [--frames 64] [--side 448] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from benchmarks.common import markdown_table, require_cuda, timed, wall_timed, write_results


def synthetic_video(frames: int, side: int, seed: int = 0) -> np.ndarray:
    """[frames, side, side, 3] uint8: colour gradients that drift frame to frame (not constant, not noise)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:side, 0:side].astype(np.float32) / side
    phase = rng.uniform(0, 2 * np.pi, 3).astype(np.float32)
    out = np.empty((frames, side, side, 3), dtype=np.uint8)
    for f in range(frames):
        t = f / max(frames, 1)
        for c in range(3):
            wave = np.sin(2 * np.pi * (x * (c + 1) + y * (3 - c) + t) + phase[c])
            out[f, :, :, c] = (127.5 + 120 * wave).astype(np.uint8)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def bench_model(name: str, args, device: str) -> list[dict]:
    import encoder
    import workspace
    from encoder.patch_batch import PatchBatch

    cpu = device == "cpu"
    dtype = torch.float32 if cpu else torch.bfloat16
    enc = encoder.load(name, device=device, dtype=dtype)
    video = synthetic_video(args.frames, args.side)
    t0 = time.perf_counter()
    batch = enc.preprocess_video([video], fps=args.fps)
    prep_ms = (time.perf_counter() - t0) * 1e3
    processor_grid = batch.grid_thw[0].tolist()
    # the tower's workload is the video at its own size (the 448² frames): where the checkpoint's video
    # processor would shrink it (Qwen3-VL's class defaults cap a video's total pixels), its full-size patches
    g, tps = args.side // enc.config.patch_size, enc.video_config.temporal_patch_size
    full = [-(-args.frames // tps), g - g % enc.config.spatial_merge_size, g - g % enc.config.spatial_merge_size]
    if processor_grid != full:
        gen = torch.Generator().manual_seed(0)
        pv = torch.randn(full[0] * full[1] * full[2], enc.config.patch_dim, generator=gen)
        batch = PatchBatch(pv, torch.tensor([full]))
    (t, h, w), patches = batch.grid_thw[0].tolist(), batch.pixel_values.shape[0]
    # pixels on the device (HF builds its positions on grid_thw's device); the host-copy row takes the CPU batch
    gpu_batch = PatchBatch(batch.pixel_values.to(device, dtype), batch.grid_thw.to(device), batch.timestamps)
    time_fn = wall_timed if cpu else timed
    rows: list[dict] = []

    def record(impl: str, ms: float, tokens: torch.Tensor | None, ref: torch.Tensor | None):
        rows.append(dict(model=name, impl=impl, ms=ms, patches=patches, grid=[t, h, w], prep_ms=prep_ms,
                         processor_grid=processor_grid,
                         patch_s=patches / ms * 1e3, rel_to_hf=None if ref is None else rel(tokens, ref)))  # fmt: skip
        print(rows[-1], flush=True)

    ref = None
    if not args.no_hf:
        from benchmarks.engine import hf_tower

        hf = hf_tower(enc, device)
        pv, grid = gpu_batch.pixel_values, gpu_batch.grid_thw
        with torch.inference_mode():
            out = hf(pv, grid_thw=grid)
            ref = (out.pooler_output if hasattr(out, "pooler_output") else out).float()
            record("HF transformers eager (sdpa)", time_fn(lambda: hf(pv, grid_thw=grid), args.iters), ref, ref)
        del hf
        if not cpu:
            torch.cuda.empty_cache()

    with torch.inference_mode():
        eager = enc.run_packed(gpu_batch).tokens
        record("ours eager", time_fn(lambda: enc.run_packed(gpu_batch), args.iters), eager, ref)
    graphs = workspace.GraphEncoder(enc)
    run = graphs.runner.run_all if graphs.runner is not None else None
    with torch.inference_mode():
        tokens = torch.cat(run(gpu_batch.pixel_values, gpu_batch.grid_thw).tokens)
        record("ours graph", time_fn(lambda: run(gpu_batch.pixel_values, gpu_batch.grid_thw), args.iters), tokens, ref)
    host = graphs.encode_llm(batch, dtype)[0].tokens
    record("ours graph + host copy (encode_llm)", time_fn(lambda: graphs.encode_llm(batch, dtype), args.iters),
           host.to(tokens.device), ref)  # fmt: skip
    stats = graphs.stats()
    rows[-1]["packs"] = {"replays": sum(stats["replays"].values()), "eager": stats["eager_runs"],
                         "exact": stats.get("exact_runs", 0)}  # fmt: skip
    assert rel(tokens.float(), eager.float()) <= (1e-5 if cpu else 2e-2), rel(tokens.float(), eager.float())
    return rows  # the tower and its graphs go with this frame (the next model's need the memory)


def report(rows: list[dict]) -> str:
    hf = {r["model"]: r["ms"] for r in rows if r["impl"].startswith("HF")}
    table = []
    for r in rows:
        speedup = f"{hf[r['model']] / r['ms']:.2f}×" if r["model"] in hf else "-"
        err = "-" if r["rel_to_hf"] is None else f"{r['rel_to_hf']:.1e}"
        table.append([r["model"], r["impl"], "×".join(map(str, r["grid"])), str(r["patches"]), f"{r['ms']:.2f}",
                      f"{r['patch_s']:.0f}", speedup, err])  # fmt: skip
    prep = {r["model"]: (r["prep_ms"], r["processor_grid"]) for r in rows}
    lines = [markdown_table(["model", "implementation", "grid (t×h×w)", "patches", "ms", "patches/s", "vs HF",
                             "rel. err. vs HF"], table, right=2)]  # fmt: skip
    lines += [
        "",
        "preprocessing (CPU, once; the processor's grid): "
        + ", ".join(f"{m} {ms:.0f} ms ({'×'.join(map(str, grid))})" for m, (ms, grid) in prep.items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3-vl-8b,qwen2.5-vl-7b")
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--side", type=int, default=448)
    parser.add_argument("--fps", type=float, default=2.0, help="the frames' rate (sampled at the processor's fps)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        default = args.models == parser.get_default("models")
        models = ["tiny-qwen3-vl", "tiny"] if default else args.models.split(",")  # tiny: the Qwen2.5-VL family
    else:
        if not require_cuda("benchmarks.video"):
            return 2
        torch.backends.cuda.matmul.allow_tf32 = True
        models = args.models.split(",")
    rows = []
    for m in models:
        rows += bench_model(m, args, args.device)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    text = report(rows)
    print("\n" + text)
    write_results(args.json, {"rows": rows, "frames": args.frames, "side": args.side}, None, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
