"""Video preprocessing (`encoder.preprocessing.video`, `resample`, `video_decode`, `encoder.patchify.patchify_video`)
against transformers' video processors' arithmetic, on a CPU without torchvision: the resize against torch's own
kernel (what torchvision calls on a uint8 CPU tensor), sampling against `torch.arange` and hand-computed indices,
sizes against transformers' formulas worked by hand, normalisation and patch order against transformers' steps
written out in torch. The processors themselves are compared in `test_video_hf_parity.py` (needs torchvision).
Decoding: PyAV-made videos in several containers, sizes, rates and lengths, and hostile ones refused quickly."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from encoder.errors import (
    ConfigError,
    DecodeTimeoutError,
    EncoderError,
    InvalidArgumentError,
    InvalidVideoError,
    VideoDecodeError,
    VideoTooLargeError,
)
from encoder.patch_batch import PatchBatch
from encoder.patchify import patchify_video, preprocess_videos
from encoder.preprocessing.resample import resize_frames
from encoder.preprocessing.video import VideoLimits, VideoPreprocessConfig, prepare_frames, qwen3_smart_resize
from encoder.preprocessing.video_decode import container_format, decode_video
from tests.video_util import decoded, frames, make_video

av = pytest.importorskip("av")

QWEN2 = VideoPreprocessConfig.defaults("qwen2")
QWEN3 = VideoPreprocessConfig.defaults("qwen3")


def torch_resize(x: np.ndarray, height: int, width: int) -> np.ndarray:
    t = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()
    out = torch.nn.functional.interpolate(t, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    return out.permute(0, 2, 3, 1).numpy()


@pytest.mark.parametrize("seed", range(4))
def test_resize_equals_torch_uint8_antialiased_bicubic(seed):
    rng = np.random.default_rng(seed)
    for _ in range(25):
        h, w = (int(v) for v in rng.integers(1, 160, 2))
        if rng.random() < 0.5:  # downscale by up to 8, the common case
            oh, ow = max(1, h // int(rng.integers(1, 9))), max(1, w // int(rng.integers(1, 9)))
        else:
            oh, ow = (int(v) for v in rng.integers(1, 200, 2))
        x = rng.integers(0, 256, (2, h, w, 3), dtype=np.uint8) if rng.random() < 0.5 else frames(2, h, w, seed)
        np.testing.assert_array_equal(resize_frames(x, oh, ow), torch_resize(x, oh, ow), err_msg=f"{h}x{w}->{oh}x{ow}")


def test_resize_to_the_same_size_is_the_input():
    x = frames(2, 28, 56)
    assert resize_frames(x, 28, 56) is x


@pytest.mark.parametrize("total", [4, 7, 9, 10, 30, 31, 97, 300, 1001])
@pytest.mark.parametrize("video_fps", [1.0, 6.0, 23.976, 30.0])
def test_qwen2_sampling_equals_transformers_arithmetic(total, video_fps):
    cfg = VideoPreprocessConfig.defaults("qwen2", do_sample_frames=True, fps=2.0)
    tps = cfg.temporal_patch_size
    max_frames = (min(cfg.max_frames, total) // tps) * tps
    n = min(max(total / video_fps * 2.0, cfg.min_frames), max_frames, total)
    n = int(n // tps) * tps
    want = torch.arange(0, total, total / n).int().numpy()
    np.testing.assert_array_equal(cfg.sample_indices(total, video_fps), want)
    fixed = VideoPreprocessConfig.defaults("qwen2", do_sample_frames=True, num_frames=3)  # rounded to 4
    if total >= 4:
        np.testing.assert_array_equal(fixed.sample_indices(total, None), torch.arange(0, total, total / 4).int())
    assert list(QWEN2.sample_indices(total, video_fps)) == list(range(total))  # Qwen2's default: no sampling


def test_qwen2_sampling_needs_the_fps_and_enough_frames():
    cfg = VideoPreprocessConfig.defaults("qwen2", do_sample_frames=True, fps=2.0)
    with pytest.raises(InvalidArgumentError, match="fps"):
        cfg.sample_indices(30, None)
    with pytest.raises(InvalidVideoError, match="too few"):
        cfg.sample_indices(1, 30.0)


def test_qwen3_sampling_and_timestamps_by_hand():
    # 9 frames at 6 fps, 2 fps: int(9 / 6 * 2) = 3 -> at least min_frames 4 -> linspace(0, 8, 4) = 0, 2.67, 5.33, 8
    assert QWEN3.sample_indices(9, 6.0).tolist() == [0, 3, 5, 8]
    assert QWEN3.timestamps([0, 3, 5, 8], 6.0) == [(0 + 0.5) / 2, (5 / 6 + 8 / 6) / 2]
    # 300 frames at 30 fps: 20 frames, linspace(0, 299, 20).round()
    assert QWEN3.sample_indices(300, 30.0).tolist() == np.linspace(0, 299, 20).round().astype(int).tolist()
    # an odd count: the last index repeated for the last temporal patch
    assert QWEN3.timestamps([0, 10, 20], 10.0) == [0.5, 2.0]
    # fps unknown: 24 (transformers' default); fewer frames than min_frames: all of them
    assert QWEN3.sample_indices(48, None).tolist() == np.linspace(0, 47, 4).round().astype(int).tolist()
    assert QWEN3.sample_indices(3, 30.0).tolist() == [0, 1, 2]
    off = VideoPreprocessConfig.defaults("qwen3", do_sample_frames=False)
    assert off.sample_indices(5, 30.0).tolist() == list(range(5))
    with pytest.raises(InvalidVideoError, match="no frames"):
        QWEN3.sample_indices(0, 30.0)


SAMPLED_QWEN2 = VideoPreprocessConfig.defaults("qwen2", do_sample_frames=True, fps=2.0)


@pytest.mark.parametrize(
    "cfg,total,video_fps",
    [(QWEN2, 12, 4.0), (QWEN2, 7, 23.976), (QWEN2, 5, None), (SAMPLED_QWEN2, 40, 10.0), (SAMPLED_QWEN2, 31, 23.976),
     (VideoPreprocessConfig.defaults("qwen2", do_sample_frames=True, num_frames=6), 13, 25.0)],
)  # fmt: skip
def test_second_per_grid_equals_transformers_sampled_fps(cfg, total, video_fps):
    """Qwen2.5-VL's `second_per_grid_ts`, as `Qwen2_5_VLProcessor._process_videos` computes it: temporal_patch_size
    over the video metadata's `sampled_fps` (transformers' own `VideoMetadata`, which needs no torchvision); the
    processor leaves `frames_indices` unset for frames given without sampling, and `sampled_fps` is then the fps."""
    from transformers.video_utils import VideoMetadata

    indices = cfg.sample_indices(total, video_fps)
    sampled = indices if cfg.do_sample_frames else None
    meta = VideoMetadata(total_num_frames=total, fps=video_fps, frames_indices=sampled)
    want = cfg.temporal_patch_size / meta.sampled_fps
    assert cfg.second_per_grid(len(indices), total, video_fps) == pytest.approx(want, rel=1e-12)
    batch = preprocess_videos(frames(total, 28, 56), cfg, fps=video_fps)
    assert batch.second_per_grid_ts == [pytest.approx(want, rel=1e-12)] and batch.timestamps is None
    assert QWEN3.second_per_grid(4, 9, 6.0) is None  # Qwen3-VL's prompt carries timestamps instead
    assert preprocess_videos(frames(9, 32, 32), QWEN3, fps=6.0).second_per_grid_ts is None


def test_video_facts_follow_their_items_through_split_and_concat():
    """Timestamps and seconds per temporal patch stay with their video when batches are cut and joined; an image
    has neither; a per-item list of the wrong length is refused."""
    qwen2 = preprocess_videos([frames(4, 28, 28), frames(6, 28, 56, seed=1)], QWEN2, fps=8.0)
    assert qwen2.second_per_grid_ts == [0.25, 0.25]
    image = PatchBatch(torch.zeros(4, QWEN2.patch_dim), [[1, 2, 2]])
    qwen3_at_14 = VideoPreprocessConfig.defaults("qwen3", patch_size=14, min_pixels=28 * 28)  # patches as Qwen2's
    qwen3 = preprocess_videos(frames(9, 28, 28), qwen3_at_14, fps=6.0)
    mixed = PatchBatch.concat([qwen2.split([1]), image, qwen3, qwen2.split([0])])
    assert mixed.second_per_grid_ts == [0.25, None, None, 0.25]
    assert mixed.timestamps == [None, None, qwen3.timestamps[0], None]
    picked = mixed.split([3, 2])
    assert picked.second_per_grid_ts == [0.25, None] and picked.second_per_grid_ts_of(0) == 0.25
    assert picked.timestamps_of(1) == qwen3.timestamps[0]
    assert PatchBatch.concat([image, image]).second_per_grid_ts is None
    with pytest.raises(InvalidArgumentError, match="second_per_grid_ts has 2 entries for 1 grid_thw rows"):
        PatchBatch(image.pixel_values, image.grid_thw, second_per_grid_ts=[0.5, 0.5])


def test_sizes_by_transformers_formulas():
    # Qwen3: the budget is over all frames (t rounded to the temporal factor): 20 frames of 480x640, max 786432
    # -> 20 * 480 * 640 > max: beta = sqrt(20 * 480 * 640 / 786432) = 2.7386...; 480 / beta / 32 = 5.47 -> 160
    assert qwen3_smart_resize(20, 480, 640, 2, 32, 131072, 786432) == (160, 224)
    assert QWEN3.target_size(20, 480, 640) == (160, 224)
    # too few pixels: scaled up to min_pixels over the frames; small frames scaled to the factor first
    assert qwen3_smart_resize(4, 48, 64, 2, 32, 131072, 786432) == (160, 224)
    assert qwen3_smart_resize(4, 10, 20, 2, 32, 131072, 786432) == (128, 256)
    with pytest.raises(InvalidVideoError, match="at least 2"):
        qwen3_smart_resize(1, 48, 64, 2, 32, 131072, 786432)
    # Qwen2: the image rule per frame
    # 480 / 28 = 17.1 -> 476, 640 / 28 = 22.9 -> 644: 306,544 pixels, within [100352, 602112]
    assert QWEN2.target_size(100, 480, 640) == (476, 644)
    # cap_pixels_per_frame, as transformers computes it
    capped = VideoPreprocessConfig.defaults("qwen3", cap_pixels_per_frame=True)
    per_frame = max(min(768 * 32 * 32, 786432 // 20), int(131072 * 1.05))
    assert capped.target_size(20, 480, 640) == qwen3_smart_resize(20, 480, 640, 2, 32, 131072, per_frame * 20)
    capped2 = VideoPreprocessConfig.defaults("qwen2", cap_pixels_per_frame=True)
    cap = max(min(602112, int(128000 * 28 * 28 * 0.9) * 2 // 600), int(100352 * 1.05))
    from encoder.preprocessing.qwen import smart_resize

    assert capped2.target_size(600, 480, 640) == smart_resize(480, 640, 28, 100352, cap)
    assert QWEN3.grid(9, 480, 640) == (5, *(s // 16 for s in QWEN3.target_size(9, 480, 640)))


def hf_video_steps(resized: np.ndarray, cfg: VideoPreprocessConfig) -> torch.Tensor:
    """transformers' video `rescale_and_normalize` and `patchify`, step by step in torch."""
    x = torch.from_numpy(resized).permute(0, 3, 1, 2)[None].to(torch.float32)  # [1, n, C, H, W]
    mean = torch.tensor(cfg.image_mean) * (1.0 / (1 / 255))
    std = torch.tensor(cfg.image_std) * (1.0 / (1 / 255))
    x = (x - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
    t, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    if pad := -x.shape[1] % t:
        x = torch.cat([x, x[:, -1:].expand(-1, pad, -1, -1, -1)], dim=1)
    _, n, c, h, w = x.shape
    x = x.view(1, n // t, t, c, h // p // m, m, p, w // p // m, m, p)
    x = x.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)  # grid t, block rows, block cols, in block, C, T, P, P
    return x.reshape((n // t) * (h // p) * (w // p), c * t * p * p)


@pytest.mark.parametrize("cfg", [QWEN2, QWEN3], ids=["qwen2", "qwen3"])
@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_patchify_video_equals_transformers_steps(cfg, n):
    resized = frames(n, 2 * cfg.factor, 3 * cfg.factor, seed=n)
    got = patchify_video(resized, cfg)
    want = hf_video_steps(resized, cfg)
    assert got.shape == want.shape == (-(-n // 2) * 2 * 3 * cfg.merge_size**2, cfg.patch_dim)
    assert torch.equal(got, want)


def test_preprocess_arrays_with_an_odd_frame_count():
    video = frames(7, 70, 100)
    batch = preprocess_videos(video, QWEN3, fps=7.0)
    prepared = prepare_frames(video, 7.0, QWEN3)
    assert prepared.indices.tolist() == np.linspace(0, 6, 4).round().astype(int).tolist()  # int(2) -> 4 frames
    h, w = QWEN3.target_size(4, 70, 100)
    assert batch.grid_thw.tolist() == [[2, h // 16, w // 16]]
    assert batch.timestamps == [QWEN3.timestamps(prepared.indices, 7.0)]
    odd = preprocess_videos(frames(5, 56, 84), QWEN2)  # no sampling: five frames, the last repeated
    assert odd.grid_thw.tolist() == [[3, *(s // 14 for s in QWEN2.target_size(5, 56, 84))]]
    assert odd.timestamps is None
    with pytest.raises(InvalidVideoError, match="uint8"):
        preprocess_videos(video.astype(np.float32), QWEN3)
    with pytest.raises(InvalidVideoError, match="shape"):
        preprocess_videos(video[0], QWEN3)
    with pytest.raises(InvalidVideoError, match="video 1: .*zero size"):
        preprocess_videos([video, video[:0]], QWEN3)


def test_config_from_transformers_files():
    d = {"video_processor_type": "Qwen2VLVideoProcessor", "min_pixels": 3136, "max_pixels": 12845056,
         "size": {"shortest_edge": 1, "longest_edge": 2}, "fps": 2.0, "do_sample_frames": True, "resample": 3,
         "image_mean": 0.5, "rescale_factor": 1 / 255}  # fmt: skip
    cfg = VideoPreprocessConfig.from_hf_dict(d, "qwen2")
    assert (cfg.min_pixels, cfg.max_pixels, cfg.fps, cfg.do_sample_frames) == (3136, 12845056, 2.0, True)
    assert cfg.image_mean == (0.5,) * 3 and cfg.image_std == QWEN2.image_std
    q3 = VideoPreprocessConfig.from_hf_dict({**d, "fps": None}, "qwen3")  # Qwen3 reads `size` only
    assert (q3.min_pixels, q3.max_pixels, q3.fps, q3.patch_size) == (1, 2, 2.0, 16)
    with pytest.raises(ConfigError, match="resample"):
        VideoPreprocessConfig.from_hf_dict({"resample": 2}, "qwen3")
    with pytest.raises(ConfigError, match="do_normalize"):
        VideoPreprocessConfig.from_hf_dict({"do_normalize": False}, "qwen3")
    with pytest.raises(ConfigError, match="mutually exclusive"):
        VideoPreprocessConfig.from_hf_dict({"num_frames": 8}, "qwen3")  # Qwen3 samples at 2 fps by default


# -- decoding -----------------------------------------------------------------------------------------------

VIDEOS = [  # (frames, height, width, fps, codec, container)
    (8, 48, 64, 10, "libx264", "mp4"),
    (9, 70, 100, 6, "libx264", "mp4"),  # odd count, sides no multiple of anything
    (30, 64, 64, 30, "libvpx-vp9", "webm"),  # WebM declares no frame count
    (5, 36, 90, 24, "libx264", "matroska"),
]


@pytest.mark.parametrize("spec", VIDEOS, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}@{s[3]}-{s[5]}")
@pytest.mark.parametrize("cfg", [QWEN2, QWEN3], ids=["qwen2", "qwen3"])
def test_decode_equals_pyav_frames_sampled(spec, cfg):
    n, h, w, fps, codec, fmt = spec
    data = make_video(n, h, w, fps, codec, fmt)
    every, rate = decoded(data)
    assert every.shape == (n, h, w, 3) and rate == fps
    sampled, indices, got_fps, total = decode_video(data, cfg)
    assert got_fps == fps and total == n
    np.testing.assert_array_equal(indices, cfg.sample_indices(n, fps))
    np.testing.assert_array_equal(sampled, every[indices])
    # bytes and the same frames as an array give the same batch
    from_bytes = preprocess_videos(data, cfg)
    from_array = preprocess_videos(every, cfg, fps=fps)
    assert torch.equal(from_bytes.pixel_values, from_array.pixel_values)
    assert from_bytes.grid_thw.tolist() == from_array.grid_thw.tolist()
    assert from_bytes.timestamps == from_array.timestamps
    assert from_bytes.second_per_grid_ts == from_array.second_per_grid_ts


def test_container_is_recognised_by_its_magic():
    assert container_format(make_video(2)) == "mov"
    assert container_format(make_video(2, codec="libvpx-vp9", fmt="webm")) == "matroska"
    assert container_format(b"\x89PNG\r\n\x1a\n" + bytes(20)) is None


def refused(data: bytes, error: type, match: str, cfg=QWEN3, within: float = 2.0) -> None:
    start = time.monotonic()
    with pytest.raises(error, match=match):
        decode_video(data, cfg)
    assert time.monotonic() - start < within


def test_hostile_and_broken_videos_get_clear_errors_quickly():
    good = make_video(12, 48, 64)
    refused(b"", VideoDecodeError, "empty")
    refused(b"\x89PNG\r\n\x1a\n" + bytes(100), VideoDecodeError, "cannot identify video data")
    refused(good[: len(good) // 2], VideoDecodeError, "cannot open|truncated|corrupt")  # the index (moov) is cut
    refused(bytes(4) + b"ftyp" + bytes(200), VideoDecodeError, "cannot open")
    refused(make_video(3, codec="mjpeg", fmt="matroska"), VideoDecodeError, "codec mjpeg is not accepted")
    # every limit, set below this small video
    for limits, match in [
        (VideoLimits(max_bytes=len(good) - 1), "max_bytes"),
        (VideoLimits(max_frame_pixels=48 * 64 - 1), "max_frame_pixels"),
        (VideoLimits(max_frames=11), "max_frames"),
        (VideoLimits(max_fps=9), "max_fps"),
        (VideoLimits(max_duration_s=1.1), "max_duration_s"),
        (VideoLimits(max_kept_pixels=4 * 48 * 64 - 1), "max_kept_pixels"),
    ]:
        refused(good, VideoTooLargeError, match, QWEN3.model_copy(update={"limits": limits}))
    slow = QWEN3.model_copy(update={"limits": VideoLimits(max_decode_s=1e-9)})
    refused(good, DecodeTimeoutError, "max_decode_s", slow)


def test_a_video_without_frames_and_a_one_frame_video():
    import io

    for fmt in ("matroska", "mp4"):  # headers written, no frame
        buf = io.BytesIO()
        container = av.open(buf, mode="w", format=fmt)
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        container.start_encoding()
        container.close()
        refused(buf.getvalue(), (InvalidVideoError, VideoDecodeError), "no frames|no video stream|cannot open")
    one = make_video(1, 48, 64)
    with pytest.raises(InvalidVideoError, match="at least 2"):
        preprocess_videos(one, QWEN3)  # as transformers' Qwen3-VL processor refuses it
    assert preprocess_videos(one, QWEN2).grid_thw.tolist()[0][0] == 1  # Qwen2 pads it to a pair


def test_errors_are_encoder_errors_naming_the_video():
    with pytest.raises(EncoderError, match="video 1: "):
        preprocess_videos([make_video(4), b"junk"], QWEN3)
    with pytest.raises(InvalidVideoError, match="unsupported video type str"):
        preprocess_videos(["clip.mp4"], QWEN3)  # paths are VisionEncoder.preprocess_video's to read
