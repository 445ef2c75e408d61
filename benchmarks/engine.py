"""Engine benchmark (one GPU run): HF transformers eager vs our eager vs our graph replay, per
attention backend, on a Qwen vision config in bf16 with random weights (default Qwen2.5-VL-7B;
`--model qwen3-vl-8b` for Qwen3-VL, whose HF tower gets the same weights).

Prints a markdown table with latency, images/s, patches/s and MFU against a bf16 matmul peak
measured in the same process. Run: `python -m benchmarks.engine [--backends triton,torch_varlen]`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import encoder
import workspace
from benchmarks.common import WORKLOADS, make_batch, matmul_peak, timed, use_backend
from benchmarks.flops import linear_flops
from encoder.attention import available_backends


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
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen2.5-vl-7b")
    parser.add_argument("--backends", default=None, help="comma list (default: every available one)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--json", default=None, help="also write results here")
    parser.add_argument(
        "--pad-compare", action="store_true",
        help="first time graph replay with the MLP width unpadded (pad_mlp=0), with the first backend",
    )  # fmt: skip
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks.engine needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = matmul_peak()
    base = encoder.load(args.model, device="cuda", dtype=torch.bfloat16)
    per_patch = linear_flops(base.config, base.config.merge_unit) / base.config.merge_unit
    usable = [n for n, why in available_backends().items() if why is None]
    names = args.backends.split(",") if args.backends else [*usable, "auto"]
    workloads = args.workloads.split(",")
    rows = []

    def record(impl, wl, ms, extra=None):
        images, side = WORKLOADS[wl]
        patches = images * (side // base.config.patch_size) ** 2
        tflops = per_patch * patches / ms / 1e9
        rows.append(dict(impl=impl, workload=wl, ms=ms, img_s=images / ms * 1e3, patch_s=patches / ms * 1e3,
                         mfu=tflops / peak, **(extra or {})))  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)

    if not args.no_hf:
        hf = hf_tower(base)
        for wl in workloads:
            batch = make_batch(base, *WORKLOADS[wl])
            with torch.inference_mode():
                record("HF transformers eager (sdpa)", wl, timed(lambda b=batch: hf(b.pixel_values, b.grid_thw), 5))
        del hf
        torch.cuda.empty_cache()

    if args.pad_compare:  # before any fuse(): padding is a one-way layout change of the shared model
        use_backend(base, names[0])
        graph = workspace.GraphEncoder(base, pad_mlp=0)
        for wl in workloads:
            batch = make_batch(base, *WORKLOADS[wl])
            run = lambda b=batch, g=graph: g.runner.run(b.pixel_values, b.grid_thw)  # noqa: E731
            record(f"ours graph ({names[0]}), MLP width {base.config.mlp_dim} unpadded", wl, timed(run, args.iters))
        del graph
        torch.cuda.empty_cache()

    for name in names:
        use_backend(base, name)
        for wl in workloads:
            batch = make_batch(base, *WORKLOADS[wl])
            record(f"ours eager ({name})", wl, timed(lambda b=batch: base.forward_packed(b), args.iters))
        t0 = time.perf_counter()
        graph = workspace.GraphEncoder(base)
        setup = time.perf_counter() - t0
        stats = graph.stats()
        for wl in workloads:
            batch = make_batch(base, *WORKLOADS[wl])
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

    print(f"\nbf16 matmul peak measured: {peak:.0f} TFLOP/s; linear work {per_patch / 1e9:.3f} GFLOP/patch\n")
    print("| implementation | workload | ms | img/s | patches/s | MFU |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['impl']} | {r['workload']} | {r['ms']:.2f} | {r['img_s']:.0f} | {r['patch_s']:.0f} | "
              f"{r['mfu'] * 100:.1f}% |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"peak_tflops": peak, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
