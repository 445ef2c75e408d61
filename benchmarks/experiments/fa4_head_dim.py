"""Would Qwen3-VL's attention run faster with its head dim 72 zero-padded to 80 (or 96, 128)? (issue 14)

Qwen3-VL-8B's vision blocks attend with 16 heads of 72. Padding each head to 80 at load time is exact (zero
rows in the qkv weight and bias, zero columns in proj's weight, softmax scale kept at 1/sqrt(72)) and costs
11% more qkv and proj GEMM work; it pays if FlashAttention-4 runs hd 80 enough faster than hd 72. This times,
in CUDA graphs (20 calls per graph, median of replays): FA4 varlen forward at the tower's shapes with q, k, v
strided views of one packed [S, 3, H, hd] buffer (as the tower hands them over), for hd 72 / 80 / 96 / 128;
the qkv and proj bias GEMMs at both widths; and checks that the padded attention equals the unpadded one.

    python -m benchmarks.experiments.fa4_head_dim            # needs a CUDA GPU and flash-attn-4

Answer (H200, 2026-12-02): padding Qwen3-VL-8B's head dim 72 to 80 saves 5.6% of FA4 at 8×896² (49.5 µs a block) but
the wider qkv and proj GEMMs cost 45 µs: a net 0.1 ms a forward, not built.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from benchmarks.common import per_call_us

HEADS, HD, WIDTH = 16, 72, 1152
# name -> (segment length, segments): 8x896², 32x224², 1x448², 1x224² at patch 16
CASES = {"8x896": (3136, 8), "32x224": (196, 32), "1x448": (784, 1), "1x224": (196, 1)}


def packed_qkv(total: int, hd: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(total, 3, HEADS, hd, device="cuda", dtype=torch.bfloat16, generator=g)


def attention(fa, qkv: torch.Tensor, cu: torch.Tensor, max_len: int) -> torch.Tensor:
    q, k, v = qkv.unbind(1)  # strided views: row stride 3 * H * hd, unit stride on hd
    out = fa(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
             softmax_scale=1 / math.sqrt(HD))  # fmt: skip
    return out[0] if isinstance(out, tuple) else out


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    from flash_attn.cute import flash_attn_varlen_func as fa

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("\n| case | hd | FA4 µs | attention TFLOP/s (hd 72 work) | vs hd 72 |\n| --- | ---: | ---: | ---: | ---: |")
    for name, (seg, n) in CASES.items():
        total = seg * n
        cu = torch.arange(0, total + 1, seg, device="cuda", dtype=torch.int32)
        base = None
        for hd in (72, 80, 96, 128):
            qkv = packed_qkv(total, hd)
            us = per_call_us(lambda qkv=qkv, cu=cu, seg=seg: attention(fa, qkv, cu, seg))
            base = base or us
            work = 4.0 * seg * seg * HD * HEADS * n
            print(f"| {name} | {hd} | {us:.1f} | {work / us / 1e6:.0f} | {us / base:.3f} |")
    # exactness of the padding: hd 72 against hd 80 with zero columns 72..79 in q, k, v
    total, seg = 3136 * 2, 3136
    cu = torch.tensor([0, seg, total], device="cuda", dtype=torch.int32)
    small = packed_qkv(total, HD, seed=1)
    padded = F.pad(small, (0, 80 - HD))
    a, b = attention(fa, small, cu, seg), attention(fa, padded, cu, seg)
    print(f"\npadded vs unpadded: max |diff| {(a - b[..., :HD]).abs().max().item():.2e} (bf16 outputs), "
          f"padding columns of the padded output max |x| {b[..., HD:].abs().max().item():.2e}")  # fmt: skip

    print("\n| GEMM (rows 25,088) | µs |\n| --- | ---: |")
    x = torch.randn(25088, WIDTH, device="cuda", dtype=torch.bfloat16)
    gemms = (("qkv 1152 -> 3456", WIDTH, 3 * WIDTH), ("qkv 1152 -> 3840 (hd 80)", WIDTH, 3840),
             ("proj 1152 -> 1152", WIDTH, WIDTH), ("proj 1280 -> 1152 (hd 80)", 1280, WIDTH))  # fmt: skip
    for label, k_in, n_out in gemms:
        w = torch.randn(n_out, k_in, device="cuda", dtype=torch.bfloat16) * 0.02
        bias = torch.randn(n_out, device="cuda", dtype=torch.bfloat16)
        inp = x if k_in == WIDTH else torch.randn(25088, k_in, device="cuda", dtype=torch.bfloat16)
        print(f"| {label} | {per_call_us(lambda inp=inp, w=w, bias=bias: F.linear(inp, w, bias)):.1f} |")


if __name__ == "__main__":
    main()
