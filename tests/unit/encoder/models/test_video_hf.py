"""Videos through the Qwen towers against Hugging Face transformers (CPU, float32): tiny Qwen2.5-VL and Qwen3-VL
checkpoints written by transformers, with a video processor file as transformers writes it; PyAV-made videos of
several sizes, frame rates and lengths (an odd frame count among them). Our tokens and DeepStack features equal
the HF model's `get_video_features` on our pixel values; the graph path (`GraphEncoder`, eager on a CPU through the
same packing, buckets smaller than a video) equals the eager one; images and videos mix in one batch."""

from __future__ import annotations

import json

import pytest
import torch

import encoder
from encoder.errors import InvalidArgumentError, VideoDecodeError
from encoder.patch_batch import PatchBatch
from encoder.patchify import patchify_many
from tests.hf_models import full_model
from tests.video_util import frames, make_video
from workspace import GraphEncoder

pytest.importorskip("av")

# video_preprocessor_config.json as transformers' save_pretrained writes them (the keys that matter here); small
# pixel budgets keep the tiny towers fast
VIDEO_PROCESSORS = {
    "qwen2_5_vl": {
        "video_processor_type": "Qwen2VLVideoProcessor", "do_sample_frames": True, "fps": 2.0, "min_frames": 4,
        "max_frames": 768, "size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 40}, "patch_size": 14,
        "temporal_patch_size": 2, "merge_size": 2, "resample": 3, "rescale_factor": 1 / 255,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    },
    "qwen3_vl": {
        "video_processor_type": "Qwen3VLVideoProcessor", "do_sample_frames": True, "fps": 2, "min_frames": 4,
        "max_frames": 768, "size": {"shortest_edge": 32 * 32 * 8, "longest_edge": 32 * 32 * 200}, "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2, "resample": 3, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
    },
}  # fmt: skip
VIDEOS = [  # (frames, height, width, fps, codec, container)
    (9, 70, 100, 6, "libx264", "mp4"),  # 4 frames sampled
    (5, 64, 64, 1, "libvpx-vp9", "webm"),  # Qwen3-VL: all 5 (odd: the last repeated); Qwen2.5-VL: 4
    (40, 48, 80, 10, "libx264", "mp4"),  # 8 frames
]


@pytest.fixture(scope="module", params=list(VIDEO_PROCESSORS))
def checkpoint(request, tmp_path_factory):
    family = request.param
    directory = tmp_path_factory.mktemp(family)
    model = full_model(family, seed=5)
    model.save_pretrained(directory)
    (directory / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSORS[family]))
    return family, directory, model


@pytest.fixture(scope="module")
def videos():
    return [make_video(n, h, w, fps, codec, fmt, seed=i) for i, (n, h, w, fps, codec, fmt) in enumerate(VIDEOS)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_video_tokens_and_deepstack_equal_hf_get_video_features(checkpoint, videos):
    family, directory, model = checkpoint
    enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
    assert enc.supports_video and enc.video_config.kind == ("qwen3" if family == "qwen3_vl" else "qwen2")
    assert enc.video_config.fps == 2.0 and enc.video_config.do_sample_frames  # the file's, over the defaults
    batch = enc.preprocess_video(videos)
    sampled = [len(enc.video_config.sample_indices(n, fps)) for n, _, _, fps, _, _ in VIDEOS]
    assert sampled == ([4, 5, 8] if family == "qwen3_vl" else [4, 4, 8])
    assert batch.grid_thw[:, 0].tolist() == [2, 3 if family == "qwen3_vl" else 2, 4]
    outs = enc.encode_llm(batch)
    with torch.no_grad():
        ref = model.model.get_video_features(batch.pixel_values, batch.grid_thw)
    deep_ref = getattr(ref, "deepstack_features", None) or []
    for i, out in enumerate(outs):
        assert out.grid_thw == tuple(batch.grid_thw[i].tolist())
        assert rel(out.tokens, ref.pooler_output[i]) <= 1e-5
        assert len(out.deepstack) == len(deep_ref) == (2 if family == "qwen3_vl" else 0)
        for k, feature in enumerate(out.deepstack):
            assert rel(feature, deep_ref[k][i]) <= 1e-5
        if family == "qwen3_vl":
            assert out.timestamps == batch.timestamps[i] and len(out.timestamps) == out.grid_thw[0]
            assert out.second_per_grid_ts is None
        else:  # what Qwen2_5_VLProcessor computes: temporal_patch_size / VideoMetadata.sampled_fps
            from transformers.video_utils import VideoMetadata

            n, fps = VIDEOS[i][0], VIDEOS[i][3]
            meta = VideoMetadata(total_num_frames=n, fps=fps, frames_indices=enc.video_config.sample_indices(n, fps))
            assert out.timestamps is None
            assert out.second_per_grid_ts == pytest.approx(enc.video_config.temporal_patch_size / meta.sampled_fps)
    means = enc.encode(batch, pooling="mean")  # one vector per video
    assert [m.shape for m in means] == [(enc.out_dim,)] * len(videos)
    for m, out in zip(means, outs, strict=True):
        torch.testing.assert_close(m, out.tokens.mean(0))


@pytest.mark.slow
def test_graph_path_equals_eager_for_mixed_videos_and_images(checkpoint, videos):
    """Buckets smaller than a video: its frames pack with the images and spill over several packs."""
    _, directory, _ = checkpoint
    enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
    f = enc.preprocess_config.factor  # small still images (below Qwen3-VL's min_pixels), patchified as they are
    images = patchify_many([torch.from_numpy(frames(1, 2 * f, 3 * f, seed=3)[0]),
                            torch.from_numpy(frames(1, 4 * f, f, seed=4)[0])], enc.preprocess_config)  # fmt: skip
    clips = enc.preprocess_video(videos[1:])
    mixed = PatchBatch.concat([images.split([0]), clips.split([0]), images.split([1]), clips.split([1])])
    frame = max(h * w for _, h, w in mixed.grid_thw.tolist())
    graphs = GraphEncoder(enc, buckets=f"{frame},{2 * frame}")
    assert max(k.budget for k in graphs.table.keys) < max(mixed.patch_counts())
    eager = enc.encode_llm(mixed)
    got = graphs.encode_llm(mixed)
    for g, e in zip(got, eager, strict=True):
        assert g.grid_thw == e.grid_thw and g.timestamps == e.timestamps
        assert g.second_per_grid_ts == e.second_per_grid_ts
        assert rel(g.tokens, e.tokens) <= 1e-5
        for gd, ed in zip(g.deepstack, e.deepstack, strict=True):
            assert rel(gd, ed) <= 1e-5
    for pooling in ("mean", "none"):
        for g, e in zip(graphs.encode(mixed, pooling), enc.encode(mixed, pooling), strict=True):
            assert rel(g, e) <= 1e-5
    stats = graphs.stats()
    assert stats["videos"] >= 2 and stats["eager_runs"] == 0 and sum(stats["replays"].values()) >= 3


def test_video_paths_and_errors(checkpoint, videos, tmp_path):
    _, directory, _ = checkpoint
    enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
    path = tmp_path / "clip.mp4"
    path.write_bytes(videos[0])
    from_path = enc.preprocess_video([str(path)])
    assert torch.equal(from_path.pixel_values, enc.preprocess_video(videos[0]).pixel_values)
    with pytest.raises(VideoDecodeError, match=r"video 1: .*broken\.mp4: .*cannot identify video data"):
        (tmp_path / "broken.mp4").write_bytes(b"not a video")
        enc.preprocess_video([videos[0], tmp_path / "broken.mp4"])
    clip = encoder.load("tiny-clip", device="cpu")
    with pytest.raises(InvalidArgumentError, match="takes no video"):
        clip.preprocess_video(videos[0])
