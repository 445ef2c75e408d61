"""GraphEncoder (bucket packing; eager on CPU) against the plain eager encoder."""

from __future__ import annotations

import random

import pytest
import torch

import encoder
import workspace
from tests.graph_cases import random_batch, rel_err, split_grids

BUCKETS = "64,256,1024"  # small budgets so CPU batches cross bucket edges


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen2-vl"])
def pair(request):
    enc = encoder.load(request.param, device="cpu")
    return enc, workspace.GraphEncoder(enc, buckets=BUCKETS)


def assert_same(graph_out, eager_out, tol=1e-5):
    assert len(graph_out) == len(eager_out)
    for g, e in zip(graph_out, eager_out, strict=True):
        assert g.shape == e.shape
        assert torch.isfinite(g).all()
        assert rel_err(g, e) <= tol


@pytest.mark.slow  # 2 x 60 graph and eager encodes: ~20 s on a 2-core CPU; the edges below stay fast
def test_random_splits_with_repeating_totals(pair):
    """60 batches: totals repeat, image splits differ; every output matches eager. (The GPU tests replay
    >= 200 random splits per bucket table: tests/unit/workspace/test_gpu_engine.py.)"""
    enc, graph = pair
    rng = random.Random(0)
    totals = [64, 256, 1024, 1020, 300]
    seen: dict[int, set] = {}
    for case in range(60):
        total = totals[case % len(totals)]
        grids = split_grids(total, rng, max_side=12 if total <= 256 else 24)
        seen.setdefault(total, set()).add(tuple(map(tuple, grids)))
        batch = random_batch(grids, enc.config.patch_dim, seed=case)
        pooling = "mean" if case % 2 else "none"
        assert_same(graph.encode(batch, pooling), enc.encode(batch, pooling))
    assert all(len(splits) > 10 for splits in seen.values()), "splits should differ for each total"


@pytest.mark.parametrize(
    "grids",
    [
        [[1, 16, 16]],  # exactly the 256 budget
        [[1, 2, 2], [1, 16, 16]],  # budget + 4
        [[1, 32, 32]],  # exactly the largest budget
        [[1, 2, 2], [1, 32, 32]],  # largest + 4: split into two packs
        [[1, 34, 32]],  # one image above the largest bucket: eager
        [[1, 8, 8]] * 40,  # more images than one replay holds
        [[1, 2, 2]],  # the smallest image
    ],
    ids=["budget", "budget+1", "largest", "largest+1", "oversize", "many", "smallest"],
)
def test_bucket_edges(pair, grids):
    enc, graph = pair
    batch = random_batch(grids, enc.config.patch_dim, seed=len(grids))
    assert_same(graph.encode(batch), enc.encode(batch))
    assert_same(graph.encode(batch, "mean"), enc.encode(batch, "mean"))


def test_max_image_count(pair):
    enc, graph = pair
    key = graph.table.largest
    grids = [[1, 2, 2]] * key.max_images
    batch = random_batch(grids, enc.config.patch_dim, seed=5)
    before = graph.stats()["replays"].get(key.budget, 0) + graph.stats()["replays"].get(256, 0)
    assert_same(graph.encode(batch), enc.encode(batch))
    after = graph.stats()["replays"].get(key.budget, 0) + graph.stats()["replays"].get(256, 0)
    assert after == before + 1, "max_images images of 4 patches must fit one replay"


def test_padding_rows_do_not_change_real_rows(pair):
    """The same image in buckets with different padding, with poisoned stale padding, is unchanged. NaN
    stale rows (an allocator's bit patterns) must be zeroed by the runner: masked keys still meet the
    values in SDPA's product (0 * NaN = NaN), so on the CPU too they would reach the real rows."""
    enc, graph = pair
    batch = random_batch([[1, 6, 10]], enc.config.patch_dim, seed=9)
    first = graph.encode(batch)[0]
    for poison in (1e4, float("nan")):  # stale rows past the real ones: huge but finite, then NaN
        for ws in graph.runner.workspaces.values():
            ws.pixel_values.fill_(poison)
        assert torch.equal(graph.encode(batch)[0], first), poison
    wide = graph.encode(random_batch([[1, 6, 10], [1, 30, 30]], enc.config.patch_dim, seed=9))[0]
    assert rel_err(wide, first) <= 1e-5


def test_replays_are_bitwise_repeatable(pair):
    enc, graph = pair
    batch = random_batch([[1, 8, 12], [1, 4, 4], [1, 10, 6]], enc.config.patch_dim, seed=11)
    a, b = graph.encode(batch), graph.encode(batch)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_stats_count_padding_and_eager(pair):
    enc, _ = pair
    graph = workspace.GraphEncoder(enc, buckets=BUCKETS)
    graph.encode(random_batch([[1, 8, 8], [1, 4, 4]], enc.config.patch_dim, seed=1))  # 80 -> 256 bucket
    graph.encode(random_batch([[1, 40, 40]], enc.config.patch_dim, seed=2))  # 1600 > 1024: eager
    s = graph.stats()
    assert s["replays"] == {256: 1}
    assert s["eager_runs"] == 1
    assert s["real_patches"] == 80 + 1600
    assert s["padded_patches"] == 256 - 80
    assert s["images"] == 3


def test_a_large_much_padded_pack_runs_eagerly_at_its_exact_size(pair):
    enc, _ = pair
    graph = workspace.GraphEncoder(enc, buckets=BUCKETS)
    graph.runner.exact_min_patches = 512  # as EXACT_MIN_PATCHES, scaled to the CPU table
    padded = random_batch([[1, 20, 20], [1, 12, 12], [1, 8, 8]], enc.config.patch_dim, seed=3)  # 608 of 1024
    full = random_batch([[1, 30, 30], [1, 10, 10], [1, 4, 6]], enc.config.patch_dim, seed=4)  # 1024 of 1024
    small = random_batch([[1, 8, 8], [1, 4, 4]], enc.config.patch_dim, seed=5)  # 80 of 256: below the size
    for batch in (padded, full, small):
        assert_same(graph.encode(batch, "none"), enc.encode(batch, "none"))
        assert_same(graph.encode(batch, "mean"), enc.encode(batch, "mean"))
    s = graph.stats()
    assert s["exact_runs"] == 2 and s["eager_runs"] == 2  # the padded batch, twice
    assert s["replays"] == {1024: 2, 256: 2}
    assert s["padded_patches"] == 2 * (256 - 80)
    graph.runner.exact_min_padding = 0.5  # 416 of 1024 padded is now too little
    graph.encode(padded)
    assert graph.stats()["replays"][1024] == 3 and graph.stats()["exact_runs"] == 2


def test_preprocess_and_encode_images(pair):
    """End to end from images: same API and results as the VisionEncoder."""
    from tests.images_util import encode, random_image

    enc, graph = pair
    images = [encode(random_image("RGB", 60, 90, seed=1), "PNG"), random_image("RGB", 200, 120, seed=2)]
    assert_same(graph.encode(images, "mean"), enc.encode(images, "mean"))
    assert torch.equal(graph.preprocess(images).pixel_values, enc.preprocess(images).pixel_values)


def test_bad_pooling_and_batch(pair):
    enc, graph = pair
    with pytest.raises(encoder.InvalidArgumentError, match="unknown pooling"):
        graph.encode(random_batch([[1, 2, 2]], enc.config.patch_dim, seed=0), pooling="max")
    bad = encoder.PatchBatch(torch.randn(12, enc.config.patch_dim), torch.tensor([[1, 3, 4]]))
    with pytest.raises(encoder.InvalidArgumentError, match="multiples of 2"):
        graph.encode(bad)


def test_encode_llm_matches_eager_and_pooling_none(pair):
    """LLM-ready outputs: graph == eager, tokens == encode(pooling="none"), grid_thw as given."""
    enc, graph = pair
    grids = [[1, 8, 12], [1, 2, 2], [1, 34, 32], [1, 6, 4]]  # one eager (above the largest bucket)
    batch = random_batch(grids, enc.config.patch_dim, seed=7)
    got, want = graph.encode_llm(batch), enc.encode_llm(batch)
    tokens = enc.encode(batch, "none")
    assert [g.grid_thw for g in got] == [tuple(r) for r in grids] == [w.grid_thw for w in want]
    for g, w, t in zip(got, want, tokens, strict=True):
        assert g.tokens.dtype == torch.float32 and g.tokens.shape == t.shape
        assert rel_err(g.tokens, w.tokens) <= 1e-5 and rel_err(w.tokens, t) == 0
        assert len(g.deepstack) == len(w.deepstack) == len(getattr(enc.config, "deepstack_visual_indexes", ()))
        for gd, wd in zip(g.deepstack, w.deepstack, strict=True):
            assert rel_err(gd, wd) <= 1e-5
    assert graph.encode_llm([]) == [] and enc.encode_llm([]) == []


def test_encode_llm_in_16_bit_is_the_rounded_float32(pair):
    """The device-side cast (`encode_llm(..., dtype)`) gives the float32 outputs rounded, nothing else."""
    enc, graph = pair
    batch = random_batch([[1, 8, 12], [1, 4, 4]], enc.config.patch_dim, seed=8)
    want = graph.encode_llm(batch)
    for dtype in (torch.bfloat16, torch.float16):
        for g, w in zip(graph.encode_llm(batch, dtype), want, strict=True):
            assert g.tokens.dtype == dtype and g.grid_thw == w.grid_thw
            assert torch.equal(g.tokens, w.tokens.to(dtype))
            assert all(torch.equal(a, b.to(dtype)) for a, b in zip(g.deepstack, w.deepstack, strict=True))


@pytest.mark.parametrize("dtype", ["bfloat16", torch.int8])
def test_encode_llm_refuses_a_dtype_that_is_not_a_float_type(pair, dtype):
    """A string raised torch's "Invalid device string: 'bfloat16'"; an integer type returned truncated outputs."""
    enc, graph = pair
    with pytest.raises(encoder.InvalidArgumentError, match="floating-point torch.dtype"):
        graph.encode_llm(random_batch([[1, 4, 4]], enc.config.patch_dim, seed=0), dtype)


def test_stats_read_while_the_device_thread_counts_a_new_bucket():
    """`stats()` runs on the replica's event loop while the device thread counts replays. Iterating the live
    Counter meets a bucket's first replay added mid-way ('dictionary changed size during iteration');
    `as_dict` copies it first. The Counter below adds a key while it is being iterated, as that thread would."""
    from collections import Counter

    from workspace.runner import RunnerStats

    class CountedMidway(Counter):
        def items(self):  # the live view, with the other thread's write between two of its items
            live = iter(super().items())
            yield next(live)
            self[4096] += 1  # the device thread's first 4096-bucket replay
            yield from live

    stats = RunnerStats(replays=CountedMidway({256: 3, 1024: 1}))
    assert stats.as_dict()["replays"] == {256: 3, 1024: 1}
