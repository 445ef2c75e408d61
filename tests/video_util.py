"""Short videos made with PyAV for the tests (H.264 in MP4, VP9 in WebM, MJPEG in Matroska), and their frames as
PyAV decodes them."""

from __future__ import annotations

import io

import numpy as np


def frames(n: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, height, width, 3]: smooth gradients with noise that move from frame to frame (compressible,
    and a resize error shows)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    out = np.empty((n, height, width, 3), dtype=np.uint8)
    for i in range(n):
        base = np.stack([(x * 3 + i * 7) % 256, (y * 2 + i * 5) % 256, ((x + y) + i * 11) % 256], axis=-1)
        out[i] = np.clip(base + rng.integers(-12, 13, base.shape), 0, 255)
    return out


def make_video(
    n: int = 8, height: int = 48, width: int = 64, fps: int = 10, codec: str = "libx264", fmt: str = "mp4", seed=0
) -> bytes:
    """An encoded video of `n` frames (`frames`) at `fps`."""
    import av

    buf = io.BytesIO()
    container = av.open(buf, mode="w", format=fmt)
    stream = container.add_stream(codec, rate=fps)
    stream.width, stream.height = width, height
    stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
    for img in frames(n, height, width, seed):
        for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)
    container.close()
    return buf.getvalue()


def decoded(data: bytes) -> tuple[np.ndarray, float]:
    """Every frame as transformers' PyAV reader gives them (rgb24, decode order), and the stream's average rate."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate)
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)]), fps
