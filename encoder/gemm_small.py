"""GEMMs for few rows (a single 224x224 image is 256 patch rows): x @ W.T + b in Triton with small tiles
and a deterministic split-K, where cuBLAS's heuristics pick tiles that leave most of the H200's 132 SMs
idle (BENCHMARKS.md: 1.08 ms of the 1.73 ms of kernels of a 256-row Qwen2.5-VL-7B forward, ~305 TFLOP/s).

Split-K without atomics on the output: each of the SPLIT_K programs of a tile writes its float32 partial
to a workspace and bumps the tile's counter; the program that arrives last sums the partials in a fixed
order (so replays are bit-identical), adds the bias, writes the output and resets the counter for the
next call (so the counters stay zero between calls and a CUDA graph can replay the kernel as is).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

if triton is not None:

    @triton.jit
    def _fence(x):
        # every thread's partial-sum stores visible GPU-wide before the tile's counter moves
        return tl.inline_asm_elementwise(
            "fence.acq_rel.gpu; mov.u32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1
        )

    @triton.jit
    def _linear_kernel(
        x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_x, stride_w, stride_o,
        HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
    ):  # fmt: skip
        pid, pid_k = tl.program_id(0), tl.program_id(1)
        tiles_n = tl.cdiv(N, BN)
        pid_m, pid_n = pid // tiles_n, pid % tiles_n
        steps = tl.cdiv(tl.cdiv(K, BK), SPLIT_K)  # K steps per split
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for i in range(0, steps):
            k = (pid_k * steps + i) * BK + offs_k
            a = tl.load(
                x_ptr + offs_m[:, None] * stride_x + k[None, :],
                mask=(offs_m[:, None] < M) & (k[None, :] < K),
                other=0.0,
            )
            b = tl.load(
                w_ptr + offs_n[:, None] * stride_w + k[None, :],
                mask=(offs_n[:, None] < N) & (k[None, :] < K),
                other=0.0,
            )
            acc = tl.dot(a, tl.trans(b), acc)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        out_at = out_ptr + offs_m[:, None] * stride_o + offs_n[None, :]
        if SPLIT_K > 1:
            tiles = tl.num_programs(0)
            tile = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
            tl.store(ws_ptr + (pid_k * tiles + pid) * BM * BN + tile, acc)
            flag = _fence(tl.full([BM, BN], 0, tl.int32))
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + pid, 1 + tl.min(tl.min(flag, 1), 0), sem="acq_rel")
            if arrived == SPLIT_K - 1:  # the last of this tile's splits: reduce in split order
                acc = tl.load(ws_ptr + pid * BM * BN + tile, cache_modifier=".cg")
                for s in range(1, SPLIT_K):
                    acc += tl.load(ws_ptr + (s * tiles + pid) * BM * BN + tile, cache_modifier=".cg")
                if HAS_BIAS:
                    acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
                tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(cnt_ptr + pid, 0)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=mask)


_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch(device, floats: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-device split-K workspace and tile counters, grown on demand, kept for the process (graphs
    captured with them keep their addresses; calls on one stream never overlap)."""
    key = (str(device),)
    ws, cnt = _SCRATCH.get(key, (None, None))
    if ws is None or ws.numel() < floats or cnt.numel() < tiles:
        ws = torch.empty(max(floats, 0 if ws is None else ws.numel()), dtype=torch.float32, device=device)
        cnt = torch.zeros(max(tiles, 0 if cnt is None else cnt.numel()), dtype=torch.int32, device=device)
        _SCRATCH[key] = (ws, cnt)
    return ws, cnt


def linear_small(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, bm: int, bn: int, bk: int, split_k: int,
    warps: int = 4, stages: int = 4,
) -> torch.Tensor:  # fmt: skip
    """x @ weight.T + bias with the given tiles (CUDA, 16-bit). x: [M, K], weight: [N, K] -> [M, N]."""
    assert x.is_cuda and x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    assert x.stride(1) == 1 and weight.stride(1) == 1
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    ws, cnt = _scratch(x.device, tiles * bm * bn * split_k if split_k > 1 else 1, tiles)
    _linear_kernel[(tiles, split_k)](
        x, weight, bias if bias is not None else weight, out, ws, cnt, M, N, K, x.stride(0), weight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk, SPLIT_K=split_k, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return out
