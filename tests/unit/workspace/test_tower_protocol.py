"""The graph runner knows towers only through `encoder.models.tower.GraphTower`: a minimal fake tower
(no Qwen, CLIP or SigLIP code) runs through it, and `workspace/` has no per-family branches."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import workspace
from encoder.models.tower import Bounds, GraphTower, TowerOutput, frames_dummy, segment_means
from tests.graph_cases import random_batch
from workspace import BucketTable, GraphRunner
from workspace.runner import GraphCaptureError


class PairSumTower(nn.Module):
    """A toy tower: output token = a linear map of the sum of each pair of patches, and a DeepStack-like
    second output (the same token doubled); every token also adds its frame's patch count, so a
    wrong frame table shows. Merge unit 2."""

    patch_dim, merge_unit, patches_per_image = 6, 2, None

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 5)
        self.calls: list[Bounds] = []

    def bucket_bounds(self, budget, max_images, max_image_patches):
        return Bounds(min(budget, max_image_patches))

    def batch_bounds(self, grid):
        return Bounds(max(h * w for _, h, w in grid))

    def dummy_frames(self, budget, max_images, bounds):
        return frames_dummy(budget, max_images, bounds, merge=1)

    def forward_packed(self, pixel_values, frames_hw, bounds):
        self.calls.append(bounds)
        # pixel_values: [S, 6] -> tokens [S / 2, 5]
        tokens = self.proj(pixel_values.view(-1, 2, 6).sum(1))
        cu = torch.nn.functional.pad((frames_hw[:, 0] * frames_hw[:, 1]).cumsum(0), (1, 0))
        slot = torch.searchsorted(cu[1:] // 2, torch.arange(tokens.shape[0]), right=True)
        sizes = torch.cat([(cu[1:] - cu[:-1]).float(), torch.zeros(1)])
        tokens = tokens + sizes[slot.clamp(max=frames_hw.shape[0])][:, None]
        return TowerOutput(tokens, segment_means(tokens, cu // 2, frames_hw.shape[0]), deepstack=[2 * tokens])


def reference(tower: PairSumTower, grids, pv) -> list[torch.Tensor]:
    outs, start = [], 0
    for t, h, w in grids:
        n = h * w  # per frame
        frames = [tower.proj(pv[start + f * n : start + (f + 1) * n].view(-1, 2, 6).sum(1)) + n for f in range(t)]
        outs.append(torch.cat(frames))
        start += t * n
    return outs


@torch.no_grad()
def test_fake_tower_runs_through_the_runner():
    tower = PairSumTower()
    assert isinstance(tower, GraphTower)
    runner = GraphRunner(tower, BucketTable.parse("16,64"), max_image_patches=64)
    grids = [[1, 2, 4], [1, 4, 4], [1, 2, 2], [1, 8, 8], [1, 10, 8]]  # fits 16, 16, 16, 64; 80 is eager
    batch = random_batch(grids, 6, seed=0)
    out = runner.run_all(batch.pixel_values, batch.grid_thw)
    ref = reference(tower, grids, batch.pixel_values)
    for got, want, deep, mean in zip(out.tokens, ref, out.deepstack, out.means, strict=True):
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(deep[0], 2 * want)
        torch.testing.assert_close(mean, want.mean(0))
    assert runner.stats.eager_runs == 1 and sum(runner.stats.replays.values()) >= 2
    assert out.pooled is None


@torch.no_grad()
def test_a_bucket_has_graph_shapes_by_longest_image():
    """Few large images and many small ones in the same bucket use different graph shapes (image slots x
    longest image), each holding what it gets; results equal the reference either way."""
    tower = PairSumTower()
    runner = GraphRunner(tower, BucketTable([workspace.BucketKey(1024, 64)]), max_image_patches=1024)
    shapes = runner.shapes[workspace.BucketKey(1024, 64)]
    assert len(shapes) > 1 and shapes[-1].max_images == 64 and shapes[-1].bounds.max_seqlen == 1024
    assert [s.launch_cost for s in shapes] == sorted(s.launch_cost for s in shapes)
    for grids in ([[1, 16, 16]] * 3, [[1, 2, 4]] * 60, [[1, 30, 30], [1, 2, 2]]):
        runner.workspaces.clear()
        batch = random_batch(grids, 6, seed=len(grids))
        out = runner.run_all(batch.pixel_values, batch.grid_thw)
        for got, want in zip(out.tokens, reference(tower, grids, batch.pixel_values), strict=True):
            torch.testing.assert_close(got, want)
        (used,) = runner.workspaces
        longest = max(h * w for _, h, w in grids)
        assert used.holds(len(grids), longest)
        assert all(s.launch_cost >= used.launch_cost for s in shapes if s.holds(len(grids), longest))
    # images that exactly fill the budget get a shape without empty slots or tiles
    runner.workspaces.clear()
    batch = random_batch([[1, 16, 16]] * 4, 6, seed=9)
    runner.run_all(batch.pixel_values, batch.grid_thw)
    (used,) = runner.workspaces
    assert (used.max_images, used.bounds.max_seqlen) == (4, 256)


@torch.no_grad()
def test_an_image_no_graph_takes_runs_alone():
    """An image over the per-image bound runs eagerly on its own: the images packed with it still replay in
    their buckets (one such image sent its whole pack, up to max_images, eager); a video's frames pack as images."""
    tower = PairSumTower()
    runner = GraphRunner(tower, BucketTable.parse("64"), max_image_patches=16)
    grids = [[1, 2, 4], [1, 2, 4], [1, 4, 6], [1, 2, 2], [2, 2, 2], [1, 2, 2]]  # 24 > 16 patches; 2 frames
    batch = random_batch(grids, 6, seed=3)
    out = runner.run_all(batch.pixel_values, batch.grid_thw)
    ref = reference(tower, grids, batch.pixel_values)
    for got, want, mean in zip(out.tokens, ref, out.means, strict=True):
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(mean, want.mean(0))
    s = runner.stats
    assert s.eager_runs == 1  # image 2 alone; the rest (the video's two frames among them) replay
    assert (s.images, s.videos) == (6, 1)
    replayed = 8 + 8 + 4 + 8 + 4
    assert (s.real_patches, s.padded_patches) == (replayed + 24, 64 * sum(s.replays.values()) - replayed)


@torch.no_grad()
def test_a_video_larger_than_a_bucket_is_split_at_its_frames():
    """A video's temporal patches are segments like images: a video over the largest bucket is split across
    packs at frame boundaries (no eager run), and its tokens, DeepStack features and mean are those of all its
    frames in order, equal to the reference."""
    tower = PairSumTower()
    runner = GraphRunner(tower, BucketTable.parse("16"), max_image_patches=16)
    grids = [[5, 2, 4], [1, 2, 2], [3, 2, 2]]  # 40 patches in frames of 8; an image; 12 in frames of 4
    batch = random_batch(grids, 6, seed=5)
    out = runner.run_all(batch.pixel_values, batch.grid_thw)
    ref = reference(tower, grids, batch.pixel_values)
    for got, want, deep, mean in zip(out.tokens, ref, out.deepstack, out.means, strict=True):
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(deep[0], 2 * want)
        torch.testing.assert_close(mean, want.mean(0))
    s = runner.stats
    assert s.eager_runs == 0 and sum(s.replays.values()) >= 4
    assert (s.images, s.videos, s.real_patches) == (3, 2, 40 + 4 + 12)


def test_runner_refuses_what_is_not_a_tower():
    with pytest.raises(TypeError, match="GraphTower"):
        GraphRunner(nn.Linear(2, 2), BucketTable.parse("16"), max_image_patches=16)


def test_fixed_resolution_tower_needs_whole_image_buckets():
    tower = PairSumTower()
    tower.patches_per_image = 8
    with pytest.raises(GraphCaptureError, match="whole images of 8 patches"):
        GraphRunner(tower, BucketTable.parse("20"), max_image_patches=8)


def test_workspace_has_no_family_branches():
    root = Path(__file__).resolve().parents[3] / "workspace"
    families = re.compile(r"qwen|clip|siglip|vit|fixed_resolution|getattr\(", re.IGNORECASE)
    for path in root.glob("*.py"):
        code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())  # comments may name them
        code = re.sub(r'"""[\s\S]*?"""', "", code)  # docstrings may name families
        assert not families.findall(code), f"{path.name} branches on a family: {families.findall(code)}"
