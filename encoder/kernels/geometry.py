"""`geometry.compute_meta` as one Triton launch.

The torch version is a chain of about 100 tiny kernels (searchsorted, integer arithmetic, cumsums,
scatters, the rotary cos/sin and their window gather). At one 224² image the H200 spent 0.19 ms of a
1.90 ms replay on them, before the first block (docs/journal/benchmarks.md, 2026-12-01 fourth session). Here one
program per block of merge units finds each unit's frame by a loop over the (few) frames, computes
its rotary angles and its window-permuted position in closed form, and writes cos/sin straight to that
position; a few more programs write `cu_seqlens` and the window boundaries, also in closed form (a
window's first token is the frame's start plus the full window rows above it plus the windows to its
left in its row). Same outputs, same dtypes, same padding rules as the torch reference.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs: geometry.compute_meta uses the torch reference
    triton = None

BLOCK_U = 4  # merge units per program (x merge_unit x head_dim cos/sin values each; 16 spilled registers)
BLOCK_K = 256  # window boundaries per program

if triton is not None:

    @triton.jit
    def _meta_kernel(
        frames_ptr, inv_ptr, cu_ptr, cos_ptr, sin_ptr, cuw_ptr, widx_ptr, winv_ptr,
        n_frames, units, slots, n_unit_blocks,
        M: tl.constexpr, MU: tl.constexpr, NW: tl.constexpr, HEAD_DIM: tl.constexpr, WINDOWS: tl.constexpr,
        BLOCK_U: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, PRECISE: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        if pid < n_unit_blocks:
            u = pid * BLOCK_U + tl.arange(0, BLOCK_U).to(tl.int64)  # [BLOCK_U] merge units
            u_ok = u < units
            tok = u * MU  # the unit's first token (HF order)
            end = tl.zeros([BLOCK_U], dtype=tl.int64)  # running end of the frames so far
            start = tl.zeros([BLOCK_U], dtype=tl.int64)
            hf = tl.zeros([BLOCK_U], dtype=tl.int64)
            wf = tl.zeros([BLOCK_U], dtype=tl.int64)
            for i in range(n_frames):
                h = tl.load(frames_ptr + 2 * i).to(tl.int64)
                w = tl.load(frames_ptr + 2 * i + 1).to(tl.int64)
                inside = (tok >= end) & (tok < end + h * w)
                start = tl.where(inside, end, start)
                hf = tl.where(inside, h, hf)
                wf = tl.where(inside, w, wf)
                end = end + h * w
            real = tok < end  # past the frames' sum: padding (zero angles, identity position)
            gw = tl.maximum(wf // M, 1)
            lu = (tok - start) // MU
            uh = lu // gw
            uw = lu % gw
            dest = u
            if WINDOWS:
                gh = hf // M
                wh = uh // NW
                wi = uw // NW
                win_h = tl.minimum(gh - wh * NW, NW)
                win_w = tl.minimum(gw - wi * NW, NW)
                dest = start // MU + wh * NW * gw + win_h * wi * NW + (uh % NW) * win_w + uw % NW
                dest = tl.where(real, dest, u)
                tl.store(winv_ptr + u, dest, mask=u_ok)
                tl.store(widx_ptr + dest, u, mask=u_ok)
            # cos/sin rows of the unit's MU tokens, [BLOCK_U, MU * HEAD_DIM]: column c is token c // HEAD_DIM
            # of the unit (row-major in the m x m block), head column j; the table is
            # [h freqs | w freqs | h freqs | w freqs], each HEAD_DIM / 4 wide
            c = tl.arange(0, BLOCK_C)
            c_ok = c < MU * HEAD_DIM
            r = c // HEAD_DIM
            j = c % HEAD_DIM
            jj = j % (HEAD_DIM // 2)
            inv = tl.load(inv_ptr + jj % (HEAD_DIM // 4), mask=c_ok, other=0.0)
            hpos = uh[:, None] * M + (r // M)[None, :]
            wpos = uw[:, None] * M + (r % M)[None, :]
            pos = tl.where((jj < HEAD_DIM // 4)[None, :], hpos, wpos)
            pos = tl.where(real[:, None], pos, 0)
            ang = pos.to(tl.float32) * inv[None, :]
            off = (dest[:, None] * MU + r[None, :]) * HEAD_DIM + j[None, :]
            mask = u_ok[:, None] & c_ok[None, :]
            if PRECISE:  # libdevice's cosf/sinf (tl.cos may lower to the approximate instructions)
                tl.store(cos_ptr + off, libdevice.cos(ang), mask=mask)
                tl.store(sin_ptr + off, libdevice.sin(ang), mask=mask)
            else:  # Triton's CPU interpreter has no libdevice: numpy's cos/sin there
                tl.store(cos_ptr + off, tl.cos(ang), mask=mask)
                tl.store(sin_ptr + off, tl.sin(ang), mask=mask)
        else:
            blk = pid - n_unit_blocks
            if blk == 0:  # cu_seqlens: [0, end of frame 0, end of frame 1, ...]
                total = tl.zeros([], dtype=tl.int64)
                tl.store(cu_ptr, total.to(tl.int32))
                for i in range(n_frames):
                    total += tl.load(frames_ptr + 2 * i).to(tl.int64) * tl.load(frames_ptr + 2 * i + 1).to(tl.int64)
                    tl.store(cu_ptr + i + 1, total.to(tl.int32))
            if WINDOWS:  # cu_window[k]: first token of window k in permuted order; the total past the last
                k = blk * BLOCK_K + tl.arange(0, BLOCK_K).to(tl.int64)
                seen = tl.zeros([BLOCK_K], dtype=tl.int64)  # windows of the frames so far
                tokens = tl.zeros([BLOCK_K], dtype=tl.int64)  # their tokens
                val = tl.zeros([BLOCK_K], dtype=tl.int64)
                found = k < 0
                for i in range(n_frames):
                    h = tl.load(frames_ptr + 2 * i).to(tl.int64)
                    w = tl.load(frames_ptr + 2 * i + 1).to(tl.int64)
                    gh = h // M
                    gw = tl.maximum(w // M, 1)
                    across = (gw + NW - 1) // NW
                    count = (gh + NW - 1) // NW * across
                    rel = tl.maximum(k - seen, 0)
                    inside = (k >= seen) & (k < seen + count)
                    wh = rel // across
                    wi = rel % across
                    first = tokens + (wh * NW * gw + tl.minimum(gh - wh * NW, NW) * wi * NW) * MU
                    val = tl.where(inside, first, val)
                    found = found | inside
                    seen += count
                    tokens += h * w
                # slots past the real windows (and the last boundary) hold the total
                val = tl.where(found & (k < slots), val, tokens)
                tl.store(cuw_ptr + k, val.to(tl.int32), mask=k <= slots)


def fused_meta(
    frames_hw: torch.Tensor,
    total: int,
    inv_freq: torch.Tensor,
    spatial_merge: int,
    head_dim: int,
    window_units: int,
    window_slots: int,
):
    """(cu_seqlens, cos, sin, cu_window, window_index, window_inverse) as `geometry.compute_meta` builds
    them; the three window tensors are None when `window_units` is 0 (no window attention)."""
    # frames_hw: [F, 2] int (device); inv_freq: [head_dim / 4] float32
    assert frames_hw.dim() == 2 and frames_hw.shape[1] == 2, frames_hw.shape
    assert head_dim % 4 == 0 and inv_freq.shape == (head_dim // 4,), (head_dim, inv_freq.shape)
    mu = spatial_merge**2
    assert total % mu == 0, (total, mu)
    frames = frames_hw.contiguous()
    dev, units, windows = frames.device, total // mu, window_units > 0
    cu = torch.empty(frames.shape[0] + 1, dtype=torch.int32, device=dev)
    cos = torch.empty(total, head_dim, dtype=torch.float32, device=dev)
    sin = torch.empty(total, head_dim, dtype=torch.float32, device=dev)
    if windows:
        cuw = torch.empty(window_slots + 1, dtype=torch.int32, device=dev)
        widx = torch.empty(units, dtype=torch.int64, device=dev)
        winv = torch.empty(units, dtype=torch.int64, device=dev)
    else:
        cuw = widx = winv = cu  # never written (WINDOWS=False)
    n_unit_blocks = triton.cdiv(units, BLOCK_U)
    n_slot_blocks = triton.cdiv(window_slots + 1, BLOCK_K) if windows else 1
    _meta_kernel[(n_unit_blocks + n_slot_blocks,)](
        frames, inv_freq, cu, cos, sin, cuw, widx, winv, frames.shape[0], units, window_slots, n_unit_blocks,
        M=spatial_merge, MU=mu, NW=max(window_units, 1), HEAD_DIM=head_dim, WINDOWS=windows, BLOCK_U=BLOCK_U,
        BLOCK_C=triton.next_power_of_2(mu * head_dim), BLOCK_K=BLOCK_K, PRECISE=frames.is_cuda, num_warps=4,
    )  # fmt: skip
    if not windows:
        return cu, cos, sin, None, None, None
    return cu, cos, sin, cuw, widx, winv
