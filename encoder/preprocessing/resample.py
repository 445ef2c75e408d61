"""Antialiased bicubic resampling of uint8 frames, equal to torch's (numpy only, no torch).

transformers' video processors (`Qwen2VLVideoProcessor`, `Qwen3VLVideoProcessor`) resize with torchvision's
`resize(..., BICUBIC, antialias=True)`, which on a uint8 CPU tensor calls torch's native uint8 kernel
(`interpolate(mode="bicubic", antialias=True)`, `aten/src/ATen/native/cpu/UpSampleKernel.cpp`): not Pillow's, whose
fixed-point weights have another precision, so the image path's PIL resize would differ by one level at some
pixels. This module is that kernel's arithmetic:

  * per output index i of a dimension (input n, output m, scale = n / m): the centre `scale * (i + 0.5)`, the
    support `2 * scale` (2 when upsampling), taps from `int(centre - support + 0.5)` (at least 0) to
    `int(centre + support + 0.5)` (at most n), weights Keys' cubic (a = -0.5) at `(j - centre + 0.5) / max(scale,
    1)`, normalised by their sum (in order, in double);
  * the weights as int16 at a precision of p bits, the largest p (at most 22) for which the largest weight times
    2^(p+1) stays under 2^15; each rounded half away from zero;
  * a pass is `(2^(p-1) + sum(pixel * weight)) >> p` clamped to 0..255, horizontal first, then vertical, each pass
    only where that side changes size (the intermediate is uint8).

`tests/unit/encoder/preprocessing/test_video_preprocess.py` checks it against `torch.nn.functional.interpolate`
bit for bit over many sizes, up and down.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

_A = -0.5  # Keys' cubic, as torch's antialiased kernel (and Pillow) use


def _cubic(x: float) -> float:
    x = abs(x)
    if x < 1.0:
        return ((_A + 2) * x - (_A + 3)) * x * x + 1
    if x < 2.0:
        return ((_A * x - 5 * _A) * x + 8 * _A) * x - 4 * _A
    return 0.0


@lru_cache(maxsize=256)
def weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(first tap [out] int64, int16 weights [out, taps] as int32, precision bits) of one dimension."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    taps = int(math.ceil(support)) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    first = np.zeros(out_size, dtype=np.int64)
    w = np.zeros((out_size, taps), dtype=np.float64)
    w_max = 0.0
    for i in range(out_size):
        center = scale * (i + 0.5)
        xmin = max(int(center - support + 0.5), 0)
        xsize = min(max(min(int(center + support + 0.5), in_size) - xmin, 0), taps)
        row = [_cubic((j + xmin - center + 0.5) * invscale) for j in range(xsize)]
        total = 0.0
        for v in row:
            total += v
        if total != 0.0:
            row = [v / total for v in row]
            w_max = max(w_max, *row)
        first[i] = xmin
        w[i, :xsize] = row
    precision = 0
    while precision < 22 and int(0.5 + w_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = w * (1 << precision)
    # C's (int)(v + 0.5) / (int)(v - 0.5): truncation toward zero, i.e. rounding half away from zero
    fixed = np.trunc(np.where(scaled < 0, scaled - 0.5, scaled + 0.5)).astype(np.int32)
    return first, fixed, precision


def _pass(x: np.ndarray, axis: int, out_size: int) -> np.ndarray:
    """One pass over `axis` of an int32 array: the weighted taps, rounded, shifted and clamped."""
    first, fixed, precision = weights(x.shape[axis], out_size)
    in_size = x.shape[axis]
    shape = list(x.shape)
    shape[axis] = out_size
    acc = np.full(shape, 1 << (precision - 1), dtype=np.int32)
    for k in range(fixed.shape[1]):
        idx = np.minimum(first + k, in_size - 1)  # taps past a row's end have weight 0
        w = fixed[:, k]
        if not w.any():
            continue
        view = [1] * x.ndim
        view[axis] = out_size
        acc += np.take(x, idx, axis=axis) * w.reshape(view)
    np.right_shift(acc, precision, out=acc)
    return np.clip(acc, 0, 255)


def resize_frames(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [N, H, W, C] -> uint8 [N, height, width, C], torch's antialiased bicubic (the module docstring).
    Frame by frame, so the int32 intermediates stay one frame's size."""
    n, h, w, c = frames.shape
    if (h, w) == (height, width):
        return frames
    out = np.empty((n, height, width, c), dtype=np.uint8)
    for i in range(n):
        x = frames[i].astype(np.int32)
        if w != width:
            x = _pass(x, 1, width)
        if h != height:
            x = _pass(x, 0, height)
        out[i] = x
    return out
