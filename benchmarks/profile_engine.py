"""Kernel-time breakdown of one eager forward (CUDA), to see what the graph replay spends on.

Run: `python benchmarks/profile_engine.py --patches 256,8192 [--backend torch_varlen]`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import encoder  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen2.5-vl-7b")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--patches", default="256,8192", help="images of 256 patches (224x224) per run")
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    enc = encoder.load(args.model, device="cuda", dtype=torch.bfloat16, attention=args.backend)
    enc.model.fuse_for_speed(128)
    for total in map(int, args.patches.split(",")):
        n = max(1, total // 256)
        grid = torch.tensor([[1, 16, 16]] * n)
        batch = encoder.PatchBatch(torch.randn(n * 256, enc.config.patch_dim, device="cuda"), grid)
        for _ in range(3):
            enc.forward_packed(batch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                enc.forward_packed(batch)
            torch.cuda.synchronize()
        print(f"\n### {n} x 224x224 ({n * 256} patches), {enc.model.backend.name}, per 5 forwards")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    return 0


if __name__ == "__main__":
    sys.exit(main())
