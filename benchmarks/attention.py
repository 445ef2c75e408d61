"""Time every available varlen attention backend at Qwen2.5-VL-7B vision shapes (H=16, D=80, bf16).

Each case is run the way the service runs it: the call is captured once in a CUDA graph and timed
over graph replays with CUDA events (median of --replays), so launch overhead and host work are
excluded just as in production.

FLOPs counted per call: sum over segments of 4 * L^2 * D * H (QK^T and PV, 2 * L^2 * D each, per
head), i.e. only the useful work; kernels that pad D=80 to 128 are not credited for the padding.

    python -m benchmarks.attention                  # all available backends, all cases
    python -m benchmarks.attention --check          # also relative error vs sdpa in fp32
    python -m benchmarks.attention --backends triton sdpa --replays 50

Prints a markdown table. Needs a CUDA GPU; exits with a message otherwise.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import timed
from encoder.attention import available_backends, get_backend, resolve_attention

# name -> (segment length, number of segments)
CASES = {
    "full 1x256": (256, 1),
    "full 1x512": (512, 1),
    "full 1x1024": (1024, 1),
    "full 16x512 (8192)": (512, 16),
    "full 8x1024 (8192)": (1024, 8),
    "full 32x256 (8192)": (256, 32),
    "full 8x4096 (32768)": (4096, 8),
    "window 64 (8192)": (64, 128),
    "window 64 (32768)": (64, 512),
}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def flops(seg_len: int, num_segments: int, heads: int, head_dim: int) -> float:
    return 4.0 * seg_len * seg_len * head_dim * heads * num_segments


def make_inputs(seg_len, num_segments, heads, head_dim, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = seg_len * num_segments
    q, k, v = (torch.randn(total, heads, head_dim, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    cu = torch.arange(0, total + 1, seg_len, device="cuda", dtype=torch.int32)
    return q, k, v, cu


def time_in_graph(backend, q, k, v, cu, max_seqlen, replays: int) -> float:
    """Median ms of one captured call, over `replays` graph replays."""
    out = torch.empty_like(q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles Triton, loads lazy modules, off the capture
        for _ in range(3):
            backend(q, k, v, cu, max_seqlen, out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend(q, k, v, cu, max_seqlen, out)
    return timed(graph.replay, replays)


def rel_error(backend, q, k, v, cu, max_seqlen) -> float:
    out = torch.zeros_like(q)
    backend(q, k, v, cu, max_seqlen, out)
    ref = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    get_backend("sdpa")(q.float(), k.float(), v.float(), cu, max_seqlen, ref)
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="*", help="default: every backend available here")
    parser.add_argument("--cases", nargs="*", choices=list(CASES), help="default: all")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=80)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--check", action="store_true", help="add relative error vs sdpa fp32")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("benchmarks/attention.py needs a CUDA GPU (timing uses CUDA graphs and events)", file=sys.stderr)
        return 2

    status = available_backends()
    names = args.backends or [n for n, why in status.items() if why is None] + ["auto"]
    dtype = DTYPES[args.dtype]
    device = torch.device("cuda")
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, "
        f"H={args.heads}, D={args.head_dim}; TFLOP/s = sum_seg 4*L^2*D*H / time"
    )
    for name, why in status.items():
        if why is not None:
            print(f"- skipped {name}: {why}")
    print()
    header = "| case | backend | ms | TFLOP/s |" + (" rel err vs sdpa fp32 |" if args.check else "")
    print(header)
    print("|" + "---|" * header.count(" |"))
    for case in args.cases or list(CASES):
        seg_len, num_segments = CASES[case]
        q, k, v, cu = make_inputs(seg_len, num_segments, args.heads, args.head_dim, dtype)
        for name in names:
            if name == "auto":  # what `attention="auto"` runs for segments of this length
                backend = resolve_attention("auto", ("full",), device, dtype, args.head_dim)["full"]
                why = None
            else:
                backend = get_backend(name)
                why = backend.supports(device, dtype, args.head_dim)
            if why is not None:
                print(f"| {case} | {name} | n/a: {why} | |" + (" |" if args.check else ""))
                continue
            ms = time_in_graph(backend, q, k, v, cu, seg_len, args.replays)
            tflops = flops(seg_len, num_segments, args.heads, args.head_dim) / (ms * 1e-3) / 1e12
            label = f"auto = {backend.choose(seg_len, args.head_dim).name}" if name == "auto" else name
            row = f"| {case} | {label} | {ms:.3f} | {tflops:.1f} |"
            if args.check:
                row += f" {rel_error(backend, q, k, v, cu, seg_len):.2e} |"
            print(row, flush=True)
        del q, k, v, cu
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
