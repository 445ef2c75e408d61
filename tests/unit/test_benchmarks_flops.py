"""The engine benchmark's FLOP counting (`benchmarks/flops.py`, CPU): linear layers 2 · rows · in · out each,
attention 4 · S² · width per segment per layer, Qwen2.5-VL's window layers cut as the tower cuts them."""

from __future__ import annotations

import pytest
import torch

from benchmarks.flops import (
    attention_flops,
    forward_flops,
    full_segments,
    largest_gemm,
    linear_flops,
    window_segments,
)
from encoder.loading.presets import preset
from encoder.models.geometry import compute_meta, count_windows, frames_of

# one image of 8 x 12 patches, one video-like image of 2 frames of 4 x 4
GRID = [[1, 8, 12], [2, 4, 4]]


def test_qwen25_tiny_by_hand():
    cfg = preset("tiny")  # width 64, SwiGLU 96, out 128, patches 3*2*14*14, depth 4, full layers 1 and 3
    assert (cfg.width, cfg.mlp_dim, cfg.out_dim, cfg.patch_dim, cfg.depth) == (64, 96, 128, 1176, 4)
    assert set(cfg.fullatt_block_indexes) == {1, 3} and cfg.window_units == 4
    rows = 96 + 2 * 16
    per_block = 2 * rows * (64 * 192 + 64 * 64 + 64 * 96 + 64 * 96 + 96 * 64)  # qkv, proj, gate, up, down
    merger = 2 * (rows // 4) * (256 * 256 + 256 * 128)
    linear = 2 * rows * 1176 * 64 + 4 * per_block + merger
    # full layers: each frame whole (96, 16, 16 tokens); window layers: 4 x 4 merge units = 64 tokens at most, the
    # 8 x 12 image's units (4 x 6) cut into 4 x 4 and 4 x 2; each 4 x 4 frame (2 x 2 units) one window of 16
    full = 4 * 64 * (96**2 + 16**2 + 16**2)
    window = 4 * 64 * (64**2 + 32**2 + 16**2 + 16**2)
    got = forward_flops(cfg, GRID)
    assert got == {"linear": linear, "attention": 2 * full + 2 * window, "total": linear + 2 * full + 2 * window,
                   "patches": rows}  # fmt: skip
    assert full_segments(GRID) == [96, 16, 16]
    assert window_segments(cfg, GRID) == [64, 32, 16, 16]


def test_qwen2_and_qwen3_attend_whole_frames_in_every_layer():
    for name, mlp_mats in (("tiny-qwen2-vl", 2), ("tiny-qwen3-vl", 2)):
        cfg = preset(name)
        assert window_segments(cfg, GRID) == []
        assert attention_flops(cfg, GRID) == cfg.depth * 4 * cfg.width * (96**2 + 16**2 + 16**2)
        rows, d, f, mu = 128, cfg.width, cfg.mlp_dim, cfg.merge_unit
        mergers = 1 + len(getattr(cfg, "deepstack_visual_indexes", ()))  # Qwen3-VL: DeepStack mergers too
        merger = 2 * (rows // mu) * (d * mu * d * mu + d * mu * cfg.out_dim)
        block = 2 * rows * (4 * d * d + mlp_mats * d * f)
        assert linear_flops(cfg, rows) == 2 * rows * cfg.patch_dim * d + cfg.depth * block + mergers * merger
    assert len(preset("tiny-qwen3-vl").deepstack_visual_indexes) == 2


@pytest.mark.parametrize("grid", [GRID, [[1, 64, 64]] * 2, [[1, 14, 22], [1, 2, 2], [3, 6, 10]]])
def test_the_segments_are_the_towers_own(grid):
    """The windows and frames counted are those `encoder.models.geometry` builds (torch reference, CPU)."""
    cfg = preset("qwen2.5-vl-7b")
    t = torch.tensor(grid)
    total = int((t[:, 0] * t[:, 1] * t[:, 2]).sum())
    slots = count_windows(grid, cfg)
    meta = compute_meta(frames_of(t), total, cfg, max_seqlen=total, window_slots=slots)
    assert full_segments(grid) == meta.cu_seqlens.diff().tolist()
    assert window_segments(cfg, grid) == meta.cu_window.diff().tolist()


def test_qwen25_7b_window_layers_are_cheaper_than_full_ones():
    """8 x 896²: 64 x 64 patches per image; window layers attend in 64-token windows, full ones over 4,096 tokens."""
    cfg = preset("qwen2.5-vl-7b")
    grid = [[1, 64, 64]] * 8
    full_layer = 8 * 4 * 1280 * 4096**2
    window_layer = 8 * 64 * 4 * 1280 * 64**2
    assert attention_flops(cfg, grid) == 4 * full_layer + 28 * window_layer
    got = forward_flops(cfg, grid)
    assert 0.05 < got["attention"] / got["total"] < 0.2


def test_largest_gemm_is_the_linear_layer_doing_the_most_work_as_the_graphs_run_it():
    # Qwen2.5-VL-7B: gate|up as one GEMM, 3420 padded to 3456, over the merger's 5120 x 5120 on a quarter of the rows
    assert largest_gemm(preset("qwen2.5-vl-7b"), 25088) == (25088, 1280, 6912)
    # Qwen3-VL-8B: the merger's 4608 x 4608 on 6,272 rows (1.33e11 multiply-adds) over fc1 1152 -> 4352 (1.26e11)
    assert largest_gemm(preset("qwen3-vl-8b"), 25088) == (6272, 4608, 4608)
    assert largest_gemm(preset("qwen3-vl-8b"), 25088, pad_mlp=0) == (6272, 4608, 4608)
    assert largest_gemm(preset("tiny"), 128, pad_mlp=0) == (32, 256, 256)  # the merger: 2.1M over gate|up 1.6M


def test_the_gpu_sampler_summarises_what_it_read_and_survives_a_failing_reader():
    import time

    from benchmarks.common import GpuSampler

    readings = iter([(1980.0, 200.0), (1500.0, 690.0), (1400.0, None), (1600.0, 700.0)])

    def read():
        return next(readings)  # StopIteration after four: the sampling ends, the run does not

    with GpuSampler(interval_s=0.001, read=read) as sampler:
        time.sleep(0.2)
    got = sampler.summary()
    assert got["gpu_samples"] == 4 and got["gpu_sampler"] == "given"
    assert (got["sm_mhz"], got["sm_mhz_min"], got["sm_mhz_max"]) == (1550.0, 1400.0, 1980.0)
    assert (got["power_w"], got["power_w_min"], got["power_w_max"]) == (690.0, 200.0, 700.0)
    empty = GpuSampler(read=lambda: (None, None))
    assert empty.summary()["sm_mhz"] is None


@pytest.mark.parametrize(
    ("model", "side", "processor", "raw"),
    [
        ("tiny-qwen3-vl", 224, 16, 14),  # Qwen3-VL's 65,536-pixel minimum scales 224² up to 256²
        ("tiny-qwen3-vl", 896, 56, 56),
        ("tiny", 224, 16, 16),  # Qwen2.5-VL, patch 14: the processor keeps 224²
        ("tiny", 896, 64, 64),
    ],
)
def test_workload_grids_as_the_processor_sizes_images(model, side, processor, raw):
    """The engine benchmark's NxS workloads are S² images as the model's processor sizes them; `raw` is the grid of
    S // patch that the benchmark used before (a size Qwen3-VL's processor never makes from 224²)."""
    import encoder
    from benchmarks.common import grid_side
    from benchmarks.engine import workload_grid

    enc = encoder.load(model, device="cpu", dtype=torch.float32)
    assert grid_side(enc, side) == processor and grid_side(enc, side, raw=True) == raw
    assert enc.num_patches(side, side) == processor**2
    if side == 224:
        assert workload_grid(enc, "32x224") == [[1, processor, processor]] * 32
