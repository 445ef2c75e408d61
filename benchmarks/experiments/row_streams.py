"""Can two CUDA streams hide a one-image replay's small kernels? (issue 15: Qwen2.5-VL-7B, 1×224²)

In a 1×224² replay the 32 blocks are a chain of ≈ 9 kernels each, and only the attention mixes rows: the
GEMMs, add+norms, rotary and SiLU·up are row-wise. So the rows can be split in two halves whose row-wise work
runs on two streams between attentions (fork after each attention, join before the next): while one half is in
a latency-bound small kernel, the other half's GEMM can use the SMs, and the 0.4 µs launch gaps overlap.
This measures that on the real tower's weights (random, bf16, `triton` attention), 32 blocks, CUDA graphs:

* `serial`: today's order, one stream, all rows;
* `split2`: row-wise work in two halves on two streams, attention over all rows (correct for any packing);
* `split2-windows`: the halves also run the window layers' attention on their own, joining only at the 4
  full-attention layers (correct only when no window crosses the split: an upper bound for `split2`);
* `split4`: like `split2` with four quarters on four streams.

Prints per variant the replay time (median of interleaved rounds), the block outputs' largest relative
difference from `serial`, and the profiler's kernel count, busy and span of one replay.

`python -m benchmarks.experiments.row_streams [--rows 256,1024] [--rounds 5]`

Answer (H200, 2026-12-04): splitting a one-image replay's rows over two CUDA streams is 13–17% slower (four streams
38–51%): a GEMM over half the rows takes nearly as long as over all of them, so the busy time doubles and the
overlap wins back only part of it.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import encoder
from benchmarks.common import graph_of, timed, trace_kernels, use_backend
from encoder.kernels.elementwise import add_norm, rotary_qkv
from encoder.models.qwen2 import norm_args


class Chain:
    """The tower's blocks as pre (add+norm1, qkv, rotary) / attention / post (proj, add+norm2, MLP) pieces."""

    def __init__(self, tower, rows: int):
        self.blocks, self.rows = tower.blocks, rows
        cfg = tower.cfg
        self.d, self.heads = cfg.width, cfg.num_heads
        self.hd = self.d // self.heads
        dev = next(tower.parameters()).device
        torch.manual_seed(0)
        self.x0 = torch.randn(rows, self.d, device=dev)  # float32 residual stream
        self.delta0 = torch.randn(rows, self.d, device=dev, dtype=next(tower.parameters()).dtype)
        ang = torch.rand(rows, self.hd // 2, device=dev) * 6.28
        self.cos, self.sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        i32 = dict(device=dev, dtype=torch.int32)
        self.cu_full = torch.tensor([0, rows], **i32)
        self.cu_win = torch.arange(0, rows + 1, 64, **i32)
        # per part size: one segment over the part, so the rotary pass zeroes no row (made here: no copies in capture)
        self.cu_part = {rows // p: torch.tensor([0, rows // p], **i32) for p in (1, 2, 4)}
        self.side_streams = [torch.cuda.Stream() for _ in range(3)]  # split4 uses three besides the current one
        self.keep: list[torch.Tensor] = []  # every intermediate stays alive during capture (no cross-stream reuse)

    def pre(self, blk, x, delta, sl, qkv, out):
        x, h = add_norm(x, delta, *norm_args(blk.norm1))
        lin = blk.attn.qkv
        torch.addmm(lin.bias, h, lin.weight.t(), out=qkv[sl])
        rotary_qkv(qkv[sl], self.cos[sl], self.sin[sl], self.heads, out[sl], self.cu_part[sl.stop - sl.start])
        self.keep += [x, h]
        return x

    def attend(self, blk, qkv, out, cu, max_len):
        q, k, v = qkv.view(qkv.shape[0], 3, self.heads, self.hd).unbind(1)
        blk.attn.backend(q, k, v, cu, max_len, out)

    def post(self, blk, x, sl, out):
        n = sl.stop - sl.start
        x, h = add_norm(blk.attn.proj(out[sl].view(n, self.d)), x, *norm_args(blk.norm2))
        delta = blk.mlp(h)
        self.keep += [x, h, delta]
        return x, delta

    def run(self, parts: int, windows_alone: bool = False) -> torch.Tensor:
        rows, step = self.rows, self.rows // parts
        slices = [slice(i * step, (i + 1) * step) for i in range(parts)]
        main = torch.cuda.current_stream()
        streams = [main, *self.side_streams[: parts - 1]]
        xs = [self.x0[sl] for sl in slices]
        deltas = [self.delta0[sl] for sl in slices]
        bufs = [
            (torch.empty(rows, 3 * self.d, device=self.x0.device, dtype=self.delta0.dtype),
             torch.empty(rows, self.heads, self.hd, device=self.x0.device, dtype=self.delta0.dtype))
            for _ in self.blocks
        ]  # fmt: skip
        self.keep += [t for b in bufs for t in b]
        n = len(self.blocks)

        def fork():
            for s in streams[1:]:
                s.wait_stream(main)

        def join():
            for s in streams[1:]:
                main.wait_stream(s)

        fork()
        for i, blk in enumerate(self.blocks):
            qkv, out = bufs[i]
            alone = windows_alone and not blk.full_attention
            for p, (s, sl) in enumerate(zip(streams, slices, strict=True)):
                with torch.cuda.stream(s):
                    if i > 0:
                        xs[p], deltas[p] = self.post(self.blocks[i - 1], xs[p], sl, bufs[i - 1][1])
                    xs[p] = self.pre(blk, xs[p], deltas[p], sl, qkv, out)
                    if alone:  # this half's windows only (cu_seqlens local to the half)
                        cu = self.cu_win[: step // 64 + 1]
                        self.attend(blk, qkv[sl], out[sl], cu, 64)
            if not alone:
                join()
                if blk.full_attention:
                    self.attend(blk, qkv, out, self.cu_full, rows)
                else:
                    self.attend(blk, qkv, out, self.cu_win, 64)
                fork()
        for p, (s, sl) in enumerate(zip(streams, slices, strict=True)):
            with torch.cuda.stream(s):
                xs[p], deltas[p] = self.post(self.blocks[n - 1], xs[p], sl, bufs[n - 1][1])
        join()
        result = torch.cat([x + d for x, d in zip(xs, deltas, strict=True)])
        self.keep.append(result)
        return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen2.5-vl-7b")
    parser.add_argument("--rows", default="256,1024")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    enc = encoder.load(args.model, device="cuda", dtype=torch.bfloat16)
    enc.model.fuse()  # as GraphEncoder does: gate|up in one GEMM, MLP width padded
    use_backend(enc, "triton")
    variants = {"serial": (1, False), "split2": (2, False), "split2-windows": (2, True), "split4": (4, False)}
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            chain = Chain(enc.model, rows)
            graphs, outs = {}, {}
            for name, (parts, alone) in variants.items():
                holder = {}
                graphs[name] = graph_of(lambda p=parts, a=alone, h=holder, c=chain: h.__setitem__("y", c.run(p, a)))
                outs[name] = holder["y"]
            for name, g in graphs.items():
                outs[name].fill_(float("nan"))
                g.replay()
            torch.cuda.synchronize()
            ref = outs["serial"]
            assert torch.isfinite(ref).all()
            times = {name: [] for name in graphs}
            for _ in range(args.rounds):
                for name, g in graphs.items():
                    times[name].append(timed(g.replay, args.iters))
            base = statistics.median(times["serial"])
            print(f"\n## {args.model}, {rows} rows, {len(chain.blocks)} blocks, triton attention\n")
            print("| variant | replay ms (median) | rounds | / serial | max rel. diff | kernels | busy µs | span µs |")
            print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
            for name, g in graphs.items():
                med = statistics.median(times[name])
                diff = ((outs[name] - ref).abs().max() / ref.abs().max()).item()
                ks = trace_kernels(g.replay, f"/tmp/row_streams_{rows}_{name}.json")
                busy = sum(e["dur"] for e in ks)
                span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
                rs = " / ".join(f"{t:.3f}" for t in times[name])
                cells = [
                    name,
                    f"{med:.3f}",
                    rs,
                    f"{med / base:.3f}",
                    f"{diff:.1e}",
                    len(ks),
                    f"{busy:.0f}",
                    f"{span:.0f}",
                ]
                print("| " + " | ".join(map(str, cells)) + " |")
            del chain, graphs, outs
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
