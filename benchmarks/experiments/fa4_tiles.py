"""FlashAttention-4's Hopper forward tile configurations at Qwen3-VL's head dim 72 (issue 14).

FA4 picks its sm90 forward tile from the head dim alone (`interface._tile_size_fwd_sm90`: 192 x 144, P from
shared memory, intra-warpgroup overlap, for head dims 65-96; tuned on H100 at other shapes). Our backend calls
the forward it wraps (`interface._flash_attn_fwd`), which also takes `tile_mn`, `mma_pv_is_rs` and
`intra_wg_overlap`. This times each configuration in CUDA graphs (20 calls per graph, median of replays) at the
tower's shapes, with q, k, v strided views of one packed [S, 3, H, 72] buffer as the tower hands them over, and
checks each against the default configuration's output. Configurations that do not compile are listed as such.

    python -m benchmarks.experiments.fa4_tiles            # needs a CUDA GPU and flash-attn-4

Answer (H200, 2026-12-02): at 8×896² FA4's default 192×144 tile is its best (≈ 404 TFLOP/s of hd-72 work); smaller
tiles win only for short segments (32×224² −24%, 1×224² −40% of attention, ≈ 3% end to end), not built (each extra
configuration is another ~3 s compile at start-up).
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks.common import per_call_us

HEADS, HD = 16, 72
# name -> (segment length, segments): 8x896², 32x224², 1x448², 1x224² at patch 16
CASES = {"8x896": (3136, 8), "32x224": (196, 32), "1x448": (784, 1), "1x224": (196, 1)}
# (tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap); None = FA4's own choice
CONFIGS = [None, (192, 128, False, True), (192, 112, False, True), (192, 160, False, True), (192, 176, False, True),
           (128, 128, True, True), (128, 128, False, True), (128, 144, False, True), (128, 176, True, True),
           (128, 192, True, True), (128, 96, True, True), (64, 128, True, True)]  # fmt: skip


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    from flash_attn.cute.interface import _flash_attn_fwd

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("\n| case | config (m, n, rs, overlap) | µs | TFLOP/s | vs default | max diff vs default |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, (seg, n) in CASES.items():
        total = seg * n
        cu = torch.arange(0, total + 1, seg, device="cuda", dtype=torch.int32)
        g = torch.Generator(device="cuda").manual_seed(0)
        qkv = torch.randn(total, 3, HEADS, HD, device="cuda", dtype=torch.bfloat16, generator=g)
        q, k, v = qkv.unbind(1)
        base_us = ref = None
        for cfg in CONFIGS:
            out = torch.full((total, HEADS, HD), float("nan"), device="cuda", dtype=torch.bfloat16)
            extra = {} if cfg is None else dict(tile_mn=cfg[:2], mma_pv_is_rs=cfg[2], intra_wg_overlap=cfg[3])

            def call(out=out, extra=extra, qkv=(q, k, v), cu=cu, seg=seg):
                _flash_attn_fwd(*qkv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seg, max_seqlen_k=seg,
                                softmax_scale=1 / math.sqrt(HD), out=out, **extra)  # fmt: skip

            try:
                call()
                torch.cuda.synchronize()
                us = per_call_us(call)
            except Exception as e:  # noqa: BLE001 - a configuration the kernel cannot build
                print(f"| {name} | {cfg} | fails: {type(e).__name__}: {str(e)[:80]} | | | |")
                continue
            if ref is None:
                ref, base_us = out.clone(), us
            diff = (out.float() - ref.float()).abs().max().item()
            work = 4.0 * seg * seg * HD * HEADS * n
            rate = work / us / 1e6
            print(f"| {name} | {cfg or 'default'} | {us:.1f} | {rate:.0f} | {us / base_us:.3f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
