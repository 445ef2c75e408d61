"""Decoding untrusted video bytes with PyAV (FFmpeg in a wheel), within `VideoLimits` (no torch).

`decode_video(data, cfg)` returns the sampled frames as transformers' PyAV reader gives them
(`frame.to_ndarray(format="rgb24")`, frames counted from 0 in decode order), the video's frame rate
(`stream.average_rate`, what transformers' PyAV reader reports) and its frame count, sampled by the config's rule
(`VideoPreprocessConfig.sample_indices`) over the frames the stream really holds:

1. The container is recognised by its first bytes (MP4 / MOV / 3GP: an ISO box; WebM / Matroska: the EBML
   header; AVI: RIFF) and opened with that demuxer named: FFmpeg never probes, so the demuxers that open other
   files or URLs (HLS, concat, image sequences) are never reached. The first video stream must be in an
   allowed codec (H.264, HEVC, VP8, VP9, AV1, MPEG-4 Part 2).
2. Header facts against the limits before anything is decoded: bytes, frame size (`max_frame_pixels`), frame
   rate (`max_fps`), the declared duration and frame count (`max_duration_s`, `max_frames`).
3. The frames are counted by demuxing (no decoding: a container's own count is missing in WebM and may lie),
   stopping at `max_frames`; the sampled indices come from that count, and what they keep decoded
   (`max_kept_pixels`) is checked.
4. One decode pass keeps the sampled frames; `max_decode_s` is checked after each frame, a frame of another size
   than the stream's or a decoder error ends it. Should the decoder give another number of frames than the
   demuxer counted (a packet of two frames), the indices are recomputed from the decoded count and, if a frame
   they need was not kept, the video is decoded once more.
Every failure is an `EncoderError`: `VideoDecodeError` (not a video, truncated, corrupt, unsupported container
or codec), `VideoTooLargeError` (a limit), `InvalidVideoError` (no frames), `DecodeTimeoutError`.
"""

from __future__ import annotations

import io
import math
import time
from dataclasses import dataclass

import numpy as np

from encoder.errors import DecodeTimeoutError, InvalidVideoError, VideoDecodeError, VideoTooLargeError, reason
from encoder.preprocessing.video import PreparedVideo, VideoLimits, VideoPreprocessConfig, prepare_sampled

CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mpeg4"})
_MOV_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip")


def container_format(data: bytes) -> str | None:
    """The FFmpeg demuxer for these bytes by their magic ("mov", "matroska", "avi"), or None."""
    head = bytes(data[:12])
    if head[4:8] in _MOV_BOXES:
        return "mov"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "avi"
    return None


@dataclass
class VideoHeader:
    """What the container says before decoding."""

    format: str
    codec: str
    width: int
    height: int
    fps: float | None


def _open(data: bytes, fmt: str):
    import av  # FFmpeg: loaded by the processes that decode videos only

    try:
        return av.open(io.BytesIO(data), mode="r", format=fmt, metadata_errors="ignore")
    except av.FFmpegError as e:
        raise VideoDecodeError(f"cannot open the video ({len(data)} bytes, {fmt}): {reason(e)}") from e


def _stream(container, fmt: str, size: int):
    streams = container.streams.video
    if not streams:
        raise VideoDecodeError(f"the {fmt} file ({size} bytes) holds no video stream")
    stream = streams[0]
    codec = stream.codec_context.name
    if codec not in CODECS:
        raise VideoDecodeError(f"video codec {codec} is not accepted (accepted: {', '.join(sorted(CODECS))})")
    return stream


def _header(container, stream, fmt: str, limits: VideoLimits) -> VideoHeader:
    width, height = int(stream.width or 0), int(stream.height or 0)
    if width <= 0 or height <= 0:
        raise VideoDecodeError(f"video stream declares no frame size ({width}x{height})")
    if width * height > limits.max_frame_pixels:
        raise VideoTooLargeError(
            f"video frames are {width}x{height} = {width * height} pixels, over the limit "
            f"max_frame_pixels={limits.max_frame_pixels}"
        )
    rate = stream.average_rate
    fps = float(rate) if rate else None
    if fps is not None and not (math.isfinite(fps) and 0 < fps <= limits.max_fps):
        raise VideoTooLargeError(f"video declares {fps:g} frames per second, over the limit max_fps={limits.max_fps:g}")
    declared = int(stream.frames or 0)
    if declared > limits.max_frames:
        raise VideoTooLargeError(f"video declares {declared} frames, over the limit max_frames={limits.max_frames}")
    if container.duration is not None and container.duration / 1e6 > limits.max_duration_s:
        raise VideoTooLargeError(
            f"video lasts {container.duration / 1e6:.1f} s, over the limit max_duration_s={limits.max_duration_s:g}"
        )
    return VideoHeader(fmt, stream.codec_context.name, width, height, fps)


def _count_frames(container, stream, limits: VideoLimits, started: float) -> int:
    import av

    count = 0
    try:
        for packet in container.demux(stream):
            if packet.size:
                count += 1
                if count > limits.max_frames:
                    raise VideoTooLargeError(f"video has more than max_frames={limits.max_frames} frames")
                if count % 256 == 0:
                    _check_time(started, limits)
    except av.FFmpegError as e:
        raise VideoDecodeError(f"video is truncated or corrupt: {reason(e)}") from e
    return count


def _check_time(started: float, limits: VideoLimits) -> None:
    if time.monotonic() - started > limits.max_decode_s:
        raise DecodeTimeoutError(f"decoding the video took more than max_decode_s={limits.max_decode_s:g} s")


def _decode_kept(data: bytes, header: VideoHeader, keep: set[int], limits: VideoLimits, started: float):
    """Decode every frame; return ({index: rgb frame} for the indices in `keep`, frames decoded)."""
    import av

    container = _open(data, header.format)
    kept: dict[int, np.ndarray] = {}
    n = 0
    try:
        stream = _stream(container, header.format, len(data))
        for frame in container.decode(stream):
            if (frame.width, frame.height) != (header.width, header.height):
                raise VideoDecodeError(
                    f"video frame {n} is {frame.width}x{frame.height}, the stream's are "
                    f"{header.width}x{header.height}: frame sizes that change are not accepted"
                )
            if n in keep:
                kept[n] = frame.to_ndarray(format="rgb24")
            n += 1
            if n > limits.max_frames:
                raise VideoTooLargeError(f"video has more than max_frames={limits.max_frames} frames")
            _check_time(started, limits)
    except av.FFmpegError as e:
        raise VideoDecodeError(f"video is truncated or corrupt at frame {n}: {reason(e)}") from e
    finally:
        container.close()
    return kept, n


def _check_kept(count: int, header: VideoHeader, limits: VideoLimits) -> None:
    pixels = count * header.width * header.height
    if pixels > limits.max_kept_pixels:
        raise VideoTooLargeError(
            f"video would keep {count} frames of {header.width}x{header.height} = {pixels} pixels decoded, over the "
            f"limit max_kept_pixels={limits.max_kept_pixels}"
        )


def read_header(data: bytes, limits: VideoLimits) -> tuple[VideoHeader, int]:
    """(the container's facts, the frames the stream holds), both checked against `limits`; nothing decoded."""
    if not data:
        raise VideoDecodeError("video bytes are empty")
    if len(data) > limits.max_bytes:
        raise VideoTooLargeError(f"video is {len(data)} bytes, over the limit max_bytes={limits.max_bytes}")
    fmt = container_format(data)
    if fmt is None:
        raise VideoDecodeError(
            f"cannot identify video data ({len(data)} bytes): not an MP4 / MOV, WebM / Matroska or AVI file"
        )
    started = time.monotonic()
    container = _open(data, fmt)
    try:
        stream = _stream(container, fmt, len(data))
        header = _header(container, stream, fmt, limits)
        total = _count_frames(container, stream, limits, started)
    finally:
        container.close()
    if total == 0:
        raise InvalidVideoError(f"the {fmt} video holds no frames")
    if header.fps and total / header.fps > limits.max_duration_s:
        raise VideoTooLargeError(
            f"video lasts {total / header.fps:.1f} s ({total} frames at {header.fps:g} fps), over the limit "
            f"max_duration_s={limits.max_duration_s:g}"
        )
    return header, total


def decode_video(data: bytes, cfg: VideoPreprocessConfig) -> tuple[np.ndarray, np.ndarray, float | None, int]:
    """(sampled frames uint8 [n, H, W, 3], their indices, the video's fps, the frames they were sampled from) of
    encoded video bytes."""
    limits = cfg.limits
    started = time.monotonic()
    header, total = read_header(bytes(data), limits)
    indices = cfg.sample_indices(total, header.fps)
    _check_kept(len(indices), header, limits)
    kept, decoded = _decode_kept(data, header, set(indices.tolist()), limits, started)
    if decoded != total:  # the decoder disagrees with the demuxer's count: sample from what it decoded
        if decoded == 0:
            raise InvalidVideoError(f"the {header.format} video decodes to no frames")
        total = decoded
        indices = cfg.sample_indices(total, header.fps)
        _check_kept(len(indices), header, limits)
        if not set(indices.tolist()) <= kept.keys():
            kept, decoded = _decode_kept(data, header, set(indices.tolist()), limits, started)
    missing = [int(i) for i in indices if int(i) not in kept]
    if missing:
        raise VideoDecodeError(f"video frames {missing[:5]} could not be decoded")
    return np.stack([kept[int(i)] for i in indices]), indices, header.fps, total


def load_video(data: bytes, cfg: VideoPreprocessConfig) -> PreparedVideo:
    """Encoded video bytes -> its sampled frames, resized (`encoder.preprocessing.video.prepare_sampled`)."""
    frames, indices, fps, total = decode_video(data, cfg)
    return prepare_sampled(frames, indices, fps, cfg, total=total)
