"""Engine benchmark (one GPU run): HF transformers eager vs our eager vs our graph replay, per attention backend,
on a Qwen vision config in bf16 with random weights (default Qwen2.5-VL-7B; `--model qwen3-vl-8b` for Qwen3-VL,
whose HF tower gets the same weights).

Prints a markdown table with latency, images/s, patches/s and utilisation, and writes the rows with `--json` /
`--markdown`. Utilisation, per workload:
  MFU (linear, burst)  the linear layers' FLOPs per second against the burst peak (the earlier column, kept).
  whole / burst        the whole forward's FLOPs (linear and attention: `benchmarks/flops.py`) per second against
                       the burst peak, a short bf16 8192³ matmul, measured at the start.
  whole / sustained    the same against the sustained peak: the tower's own largest GEMM at the workload's row
                       count looped for --sustain-s seconds (≥ 2), the GPU's SM clock and power sampled meanwhile.
Both peaks are measured in this process, before the rows; the burst peak again at the end. A workload NxS is N
random square images of S pixels a side as the model's processor sizes them (Qwen3-VL: a 224² image becomes 16 x 16
patches, its 65,536-pixel minimum); `--raw-grid`: S // patch-size patches a side instead.

    python -m benchmarks.engine [--model qwen3-vl-8b] [--backends triton,torch_varlen] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from benchmarks.common import (
    WORKLOADS,
    grid_side,
    make_batch,
    markdown_table,
    matmul_peak,
    require_cuda,
    sustained_peak,
    timed,
    use_backend,
    write_results,
)
from benchmarks.flops import forward_flops, largest_gemm, linear_flops


def workload_grid(enc, workload: str, raw: bool = False) -> list[list[int]]:
    """[[t, h, w], ...] in patches: the workload's images, square, one frame each, sized as the model's processor
    sizes them (`benchmarks.common.grid_side`; `raw`: side // patch size)."""
    images, side = WORKLOADS[workload]
    g = grid_side(enc, side, raw)
    return [[1, g, g]] * images


def measure_peaks(cfg, work: dict[str, dict], seconds: float) -> tuple[float, dict]:
    """The burst peak (TFLOP/s), then the sustained peak of each workload's largest GEMM (one run per distinct
    shape), each with its clocks and power."""
    burst = matmul_peak()
    sustained, by_shape = {}, {}
    for wl, w in work.items():
        shape = largest_gemm(cfg, w["patches"])
        if shape not in by_shape:
            by_shape[shape] = sustained_peak(*shape, seconds=seconds)
            s = by_shape[shape]
            clocks = f"{_fmt(s['sm_mhz'])} MHz ({_fmt(s['sm_mhz_min'])}-{_fmt(s['sm_mhz_max'])})"
            print(f"sustained peak, {wl}: {s['tflops']:.0f} TFLOP/s on {'x'.join(map(str, shape))} over "
                  f"{s['seconds']:.1f} s; SM {clocks}, {_fmt(s['power_w'])} W "
                  f"({s['gpu_sampler'] or 'no sampler'}, {s['gpu_samples']} samples)", flush=True)  # fmt: skip
        sustained[wl] = by_shape[shape]
    return burst, sustained


def _fmt(value) -> str:
    return "?" if value is None else f"{value:.0f}"


def hf_tower(enc, device: str = "cuda"):
    """The transformers vision tower of the same family and config, holding our weights (bf16, sdpa)."""
    cfg = enc.config
    if cfg.family == "qwen3_vl":
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as Model

        hf_cfg = Qwen3VLVisionConfig(
            depth=cfg.depth, hidden_size=cfg.width, intermediate_size=cfg.mlp_dim, num_heads=cfg.num_heads,
            out_hidden_size=cfg.out_dim, num_position_embeddings=cfg.num_position_embeddings,
            deepstack_visual_indexes=list(cfg.deepstack_visual_indexes), patch_size=cfg.patch_size,
        )  # fmt: skip
    elif cfg.family == "qwen2_vl":  # its HF config names the width embed_dim and the output hidden_size
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as Model

        hf_cfg = Qwen2VLVisionConfig(
            depth=cfg.depth, embed_dim=cfg.embed_dim, hidden_size=cfg.hidden_size, mlp_ratio=round(cfg.mlp_ratio),
            num_heads=cfg.num_heads,
        )  # fmt: skip
        assert hf_cfg.mlp_ratio == cfg.mlp_ratio, cfg.mlp_ratio  # transformers 5.25 takes an int only
    else:
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as Model

        hf_cfg = Qwen2_5_VLVisionConfig(
            depth=cfg.depth, hidden_size=cfg.width, intermediate_size=cfg.mlp_dim, num_heads=cfg.num_heads,
            out_hidden_size=cfg.out_dim, fullatt_block_indexes=list(cfg.fullatt_block_indexes),
            window_size=cfg.window_size,
        )  # fmt: skip
    hf_cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = Model(hf_cfg).to(enc.dtype).eval()
    state = {k: v for k, v in enc.model.state_dict().items()}
    state["patch_embed.proj.weight"] = state["patch_embed.proj.weight"].view(model.patch_embed.proj.weight.shape)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("inv_freq" in k for k in missing), (missing, unexpected)
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-vl-7b")
    parser.add_argument("--backends", default=None, help="comma list (default: every available one)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--json", default=None, help="also write results here")
    parser.add_argument("--markdown", default=None, help="also write the table here")
    parser.add_argument("--quantization", default=None, choices=["fp8"], help="our tower's block linears in fp8")
    parser.add_argument("--fp8-fast-accum", action="store_true", help="fp8 GEMMs without float32 promotion")
    parser.add_argument("--sustain-s", type=float, default=2.0, help="seconds each sustained-peak GEMM loops (>= 2)")
    parser.add_argument(
        "--raw-grid", action="store_true",
        help="images of side // patch-size patches, not sized by the model's processor (Qwen3-VL: 14² for 224²)",
    )  # fmt: skip
    parser.add_argument(
        "--pad-compare", action="store_true",
        help="first time graph replay with the MLP width unpadded (pad_mlp=0), with the first backend",
    )  # fmt: skip
    args = parser.parse_args()
    if args.quantization and not args.no_hf:
        parser.error("--quantization: HF's tower copies our bf16 weights; pass --no-hf (and run bf16 beside)")
    if not require_cuda("benchmarks.engine"):
        return 2
    import encoder
    import workspace
    from encoder.attention import available_backends

    torch.backends.cuda.matmul.allow_tf32 = True
    if args.fp8_fast_accum:
        from encoder.models.fp8 import Fp8Linear

        Fp8Linear.fast_accum = True
    base = encoder.load(args.model, device="cuda", dtype=torch.bfloat16, quantization=args.quantization)
    cfg = base.config
    usable = [n for n, why in available_backends().items() if why is None]
    names = args.backends.split(",") if args.backends else [*usable, "auto"]
    workloads = args.workloads.split(",")
    grids = {wl: workload_grid(base, wl, args.raw_grid) for wl in workloads}
    work = {wl: forward_flops(cfg, grid) for wl, grid in grids.items()}
    peak, sustained = measure_peaks(cfg, work, max(args.sustain_s, 2.0))
    print("workloads (patches per image):", ", ".join(f"{wl} {g[0][1] * g[0][2]}" for wl, g in grids.items()))
    rows = []

    def record(impl, wl, ms, extra=None):
        images, _ = WORKLOADS[wl]
        w = work[wl]
        impl += f", {args.quantization}" if args.quantization and impl.startswith("ours") else ""
        impl += " fast-accum" if args.fp8_fast_accum and args.quantization and impl.startswith("ours") else ""
        tflops = w["total"] / ms / 1e9
        rows.append(dict(impl=impl, workload=wl, ms=ms, img_s=images / ms * 1e3, patch_s=w["patches"] / ms * 1e3,
                         mfu=w["linear"] / ms / 1e9 / peak, tflops=tflops, util_burst=tflops / peak,
                         util_sustained=tflops / sustained[wl]["tflops"], **(extra or {})))  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)

    if not args.no_hf:
        hf = hf_tower(base)
        for wl in workloads:
            batch = make_batch(base, *WORKLOADS[wl], raw=args.raw_grid)
            with torch.inference_mode():
                record("HF transformers eager (sdpa)", wl, timed(lambda b=batch: hf(b.pixel_values, b.grid_thw), 5))
        del hf
        torch.cuda.empty_cache()

    if args.pad_compare:  # before any fuse(): padding is a one-way layout change of the shared model
        use_backend(base, names[0])
        graph = workspace.GraphEncoder(base, pad_mlp=0)
        for wl in workloads:
            batch = make_batch(base, *WORKLOADS[wl], raw=args.raw_grid)
            run = lambda b=batch, g=graph: g.runner.run(b.pixel_values, b.grid_thw)  # noqa: E731
            record(f"ours graph ({names[0]}), MLP width {cfg.mlp_dim} unpadded", wl, timed(run, args.iters))
        del graph
        torch.cuda.empty_cache()

    for name in names:
        use_backend(base, name)
        for wl in workloads:
            batch = make_batch(base, *WORKLOADS[wl], raw=args.raw_grid)
            with torch.inference_mode():  # as HF's rows and every GraphEncoder call
                record(f"ours eager ({name})", wl, timed(lambda b=batch: base.forward_packed(b), args.iters))
        t0 = time.perf_counter()
        graph = workspace.GraphEncoder(base)
        setup = time.perf_counter() - t0
        stats = graph.stats()
        for wl in workloads:
            batch = make_batch(base, *WORKLOADS[wl], raw=args.raw_grid)
            run = lambda b=batch, g=graph: g.runner.run(b.pixel_values, b.grid_thw)  # noqa: E731
            record(f"ours graph ({name})", wl, timed(run, args.iters),
                   {"capture_s": stats["capture_seconds"], "capture_gib": stats["capture_bytes"] / 2**30,
                    "setup_s": setup, "captures": stats["captures"], "attention": stats["attention"]})  # fmt: skip
            record(
                f"ours graph + host copy, mean ({name})",
                wl,
                timed(lambda b=batch, g=graph: g.encode(b, "mean"), args.iters),
            )
        del graph
        torch.cuda.empty_cache()

    peak_end = matmul_peak()
    text = report(args.model, cfg, peak, peak_end, sustained, work, rows)
    print("\n" + text)
    write_results(args.json, {"model": args.model, "peak_tflops": peak, "peak_tflops_end": peak_end,
                              "sustained": sustained, "flops": work, "rows": rows}, args.markdown, text)  # fmt: skip
    return 0


def report(model, cfg, peak, peak_end, sustained, work, rows) -> str:
    """The run's markdown: the peaks with their clocks and power, each workload's FLOPs, the rows."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "?"
    lines = [f"{model}, bf16, {gpu}; burst peak (bf16 8192³ matmul) {peak:.0f} TFLOP/s at the start, "
             f"{peak_end:.0f} at the end; linear work {linear_flops(cfg, cfg.merge_unit) / cfg.merge_unit / 1e9:.3f} "
             "GFLOP/patch", ""]  # fmt: skip
    peaks = []
    for wl, w in work.items():
        s = sustained[wl]
        peaks.append([wl, str(w["patches"]), f"{w['linear'] / 1e9:.1f}", f"{w['attention'] / 1e9:.1f}",
                      f"{w['attention'] / w['total'] * 100:.1f}%", "x".join(map(str, s["shape"])), f"{s['tflops']:.0f}",
                      f"{s['seconds']:.1f}", _fmt(s["sm_mhz"]), f"{_fmt(s['sm_mhz_min'])}-{_fmt(s['sm_mhz_max'])}",
                      _fmt(s["power_w"])])  # fmt: skip
    lines += [markdown_table(["workload", "patches", "linear GFLOP", "attention GFLOP", "attention share",
                              "largest GEMM", "sustained TFLOP/s", "s", "SM MHz", "SM MHz range", "W"],
                             peaks), ""]  # fmt: skip
    table = [[r["impl"], r["workload"], f"{r['ms']:.2f}", f"{r['img_s']:.0f}", f"{r['patch_s']:.0f}",
              f"{r['tflops']:.0f}", f"{r['mfu'] * 100:.1f}%", f"{r['util_burst'] * 100:.1f}%",
              f"{r['util_sustained'] * 100:.1f}%"] for r in rows]  # fmt: skip
    header = ["implementation", "workload", "ms", "img/s", "patches/s", "TFLOP/s (whole)", "MFU (linear, burst)",
              "whole / burst", "whole / sustained"]  # fmt: skip
    lines.append(markdown_table(header, table, right=2))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
