"""`preprocess_videos` against transformers' own `Qwen2VLVideoProcessor` / `Qwen3VLVideoProcessor` on the same
decoded frames (uint8 arrays with their fps as video metadata): `pixel_values_videos` equal (<= 1e-6; the same
arithmetic gives them bit for bit), `video_grid_thw` equal, Qwen3-VL's timestamps as its processor computes
them from the sampled indices, and Qwen2.5-VL's `second_per_grid_ts` as its processor computes it from the video
metadata. transformers' video processors need torchvision (their resize is torchvision's),
which does not install beside the CPU torch of the development machines: the test is skipped there and runs on
the GPU machine (`bash benchmarks/device_run.sh video`). No PyAV needed."""

from __future__ import annotations

import pytest

from encoder.patchify import preprocess_videos
from encoder.preprocessing.video import VideoPreprocessConfig
from tests.video_util import frames

pytest.importorskip("torchvision", reason="transformers' video processors resize with torchvision (not installed)")

SMALL2 = {"size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 20}}
SMALL3 = {"size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 60}}
CASES = [  # (kind, settings over the class defaults, frames, height, width, fps)
    ("qwen2", {}, 5, 70, 100, 30.0),  # no sampling (the class default): 5 frames, the last repeated
    ("qwen2", {"do_sample_frames": True, "fps": 2.0}, 40, 48, 80, 10.0),
    ("qwen2", {"do_sample_frames": True, "fps": 2.0, **SMALL2}, 31, 120, 200, 23.976),  # downscaled
    ("qwen2", {"do_sample_frames": True, "num_frames": 6}, 13, 90, 60, 25.0),
    ("qwen2", {"cap_pixels_per_frame": True, "max_video_tokens": 200}, 8, 300, 420, 30.0),
    ("qwen3", {}, 9, 70, 100, 6.0),  # 2 fps: 4 frames
    ("qwen3", {}, 5, 64, 64, 1.0),  # all 5: odd
    ("qwen3", {**SMALL3}, 20, 480, 640, 30.0),  # downscaled over all frames
    ("qwen3", {}, 12, 20, 30, 12.0),  # frames smaller than the factor
    ("qwen3", {"cap_pixels_per_frame": True}, 60, 240, 320, 30.0),
    ("qwen3", {"do_sample_frames": False}, 7, 64, 96, 24.0),
]


def hf_processor(kind: str, settings: dict):
    from transformers import Qwen2VLVideoProcessor, Qwen3VLVideoProcessor

    cls = Qwen2VLVideoProcessor if kind == "qwen2" else Qwen3VLVideoProcessor
    return cls(**settings)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[2]}x{c[3]}x{c[4]}@{c[5]:g}-{sorted(c[1])}")
def test_preprocess_video_equals_transformers(case):
    kind, settings, n, h, w, fps = case
    video = frames(n, h, w, seed=n + h)
    settings = {"cap_pixels_per_frame": False, **settings}
    hf = hf_processor(kind, settings)
    out = hf(
        videos=[video],
        video_metadata=[{"total_num_frames": n, "fps": fps, "frames_indices": list(range(n))}],
        return_tensors="pt",
        return_metadata=True,
    )
    cfg = VideoPreprocessConfig.from_hf_dict(settings, kind)
    ours = preprocess_videos(video, cfg, fps=fps)
    assert ours.grid_thw.tolist() == out["video_grid_thw"].tolist()
    want = out["pixel_values_videos"]
    assert ours.pixel_values.shape == want.shape
    assert (ours.pixel_values - want).abs().max().item() <= 1e-6
    if kind == "qwen3":
        from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

        indices = out["video_metadata"][0].frames_indices
        stamps = Qwen3VLProcessor._calculate_timestamps(None, indices, fps, cfg.temporal_patch_size)
        assert ours.timestamps == [stamps]
    else:  # Qwen2_5_VLProcessor._process_videos: temporal_patch_size / the metadata's sampled fps
        per_grid = cfg.temporal_patch_size / out["video_metadata"][0].sampled_fps
        assert ours.second_per_grid_ts == [pytest.approx(per_grid, rel=1e-12)]


def test_the_saved_processor_file_reads_back():
    """A processor transformers saves (`to_dict`) gives the same config as the one it was made from."""
    for kind, settings in (("qwen2", {"do_sample_frames": True, "fps": 2.0, **SMALL2}), ("qwen3", SMALL3)):
        saved = hf_processor(kind, settings).to_dict()
        cfg = VideoPreprocessConfig.from_hf_dict(saved, kind)
        assert cfg == VideoPreprocessConfig.from_hf_dict(settings, kind)
