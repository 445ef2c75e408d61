"""CLIP, SigLIP, DINOv2 and DINOv3 (fixed-resolution towers) in the graph runner, eager on CPU, against the eager
encoder, and in the batch job's actor (no Ray). The towers against Hugging Face are `test_clip_siglip.py`,
`test_dinov2.py`, `test_dinov3.py`."""

from __future__ import annotations

import pytest
import torch

import encoder
import workspace
from encoder import InvalidArgumentError
from tests.graph_cases import random_batch, rel_err
from tests.images_util import encode, random_image
from workspace.tables import fixed_table, image_count_table

# ------------------------------------------------------------------------------------------ graph runner


# SigLIP's graph-runner tests (10 s on the loaded CI box) run in the full suite; CLIP's stay in -m "not slow"
@pytest.fixture(
    scope="module",
    params=["tiny-clip", pytest.param("tiny-siglip", marks=pytest.mark.slow), "tiny-dinov2", "tiny-dinov3"],
)
def pair(request):
    enc = encoder.load(request.param, device="cpu")
    # buckets of 1, 2, 4 and 8 images: batches cross bucket edges and split into several replays
    table = image_count_table([1, 2, 4, 8], enc.config.num_patches)
    return enc, workspace.GraphEncoder(enc, buckets=table)


def random_images(n: int, patch_dim: int, patches: int, seed: int) -> encoder.PatchBatch:
    g = int(patches**0.5)
    return random_batch([[1, g, g]] * n, patch_dim, seed)


def test_graph_runner_equals_eager(pair):
    """Every pooling at every batch size, those that replay one bucket twice (17 = 8 + 8 + 1) included: a pooled
    output read from the bucket's buffer without a copy was overwritten by the next replay (the first eight of
    17 images got the second eight's CLIP embeddings) and a random choice of pooling per size missed it."""
    enc, graph = pair
    images_before = graph.stats()["images"]
    poolings = ["model", "mean", "none", "model-l2", "mean-l2", None]
    for case, n in enumerate([1, 2, 3, 4, 5, 8, 9, 17, 1, 7]):
        batch = random_images(n, enc.config.patch_dim, enc.config.num_patches, seed=case)
        for pooling in poolings:
            outs, refs = graph.encode(batch, pooling), enc.encode(batch, pooling)
            assert len(outs) == n
            for o, r in zip(outs, refs, strict=True):
                assert o.shape == r.shape and torch.isfinite(o).all()
                assert rel_err(o, r) <= 1e-5, (n, pooling)
    stats = graph.stats()
    assert set(stats["replays"]) <= {k.budget for k in graph.table} and stats["eager_runs"] == 0
    # 17 images: 8 + 8 + 1; 9: 8 + 1; the smallest bucket that fits each pack
    assert stats["images"] - images_before == 57 * len(poolings)


def test_graph_padding_and_repeatability(pair):
    enc, graph = pair
    patches = enc.config.num_patches
    batch = random_images(3, enc.config.patch_dim, patches, seed=5)  # the 4-image bucket: one padding slot
    first = graph.encode(batch, "model")
    for ws in graph.runner.workspaces.values():
        ws.pixel_values.fill_(1e4)  # stale padding rows: huge but finite
    second = graph.encode(batch, "model")
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    wide = graph.encode(random_images(8, enc.config.patch_dim, patches, seed=5), "model")[:3]
    assert all(rel_err(a, b) <= 1e-5 for a, b in zip(wide, first, strict=True))


def test_image_count_tables():
    assert [(k.budget, k.max_images) for k in fixed_table(256)][-1] == (256 * 256, 256)
    assert [k.max_images for k in fixed_table(729, max_tokens=8192)] == [1, 2, 4, 8, 11]
    # patch-budget specs (the service's and batch jobs' buckets) become whole images
    assert [(k.budget, k.max_images) for k in fixed_table(256, "256,1024")] == [(256, 1), (1024, 4)]
    assert [k.max_images for k in fixed_table(729, "256,512")] == [1]  # none holds an image: one
    assert [k.max_images for k in fixed_table(64, [(256, 1), (1024, 16)])] == [1, 16]
    enc = encoder.load("tiny-clip", device="cpu")
    with pytest.raises(workspace.GraphCaptureError, match="whole images"):
        workspace.GraphRunner(enc.model, workspace.BucketTable.parse("100"), max_image_patches=64)


def test_graph_encoder_on_images(pair):
    enc, graph = pair
    images = [encode(random_image("RGB", 90, 60, seed=1), "JPEG"), random_image("RGB", 200, 120, seed=2)]
    for pooling in ("model", "mean"):
        for g, e in zip(graph.encode(images, pooling), enc.encode(images, pooling), strict=True):
            assert rel_err(g, e) <= 1e-5


# ------------------------------------------------------------------------------------------ batch path


def test_batch_actor_encodes_clip(tmp_path):
    """`deployments.batch`: decode stage + EncoderActor (no Ray) with the model's default pooling."""
    import pyarrow as pa

    from deployments.batch import EncoderActor, decode_batch, output_schema
    from deployments.batch.model_facts import actor_plan, preprocess_config_for, resolve_pooling

    assert resolve_pooling(None, "tiny-clip") == "model" and resolve_pooling(None, "tiny") == "mean"
    with pytest.raises(InvalidArgumentError, match="needs a model"):
        resolve_pooling("model", "tiny")
    assert [k.max_images for k in actor_plan("tiny-clip", "cpu", "256,512").table] == [4, 8]
    pp = preprocess_config_for("tiny-clip")
    images = [encode(random_image("RGB", 40 + 9 * i, 70, seed=i), "PNG") for i in range(5)]
    table = pa.table({"id": list(range(6)), "image": [*images, b"not an image"]})
    decoded = decode_batch(table, image_column="image", pp=pp, path_root=None)
    actor = EncoderActor("tiny-clip", pooling=None, buckets="256,512", preprocess_config=pp)
    out = actor(decoded)
    assert out.schema == output_schema(table.schema, "image", "model", 48)
    ref = encoder.load("tiny-clip", device="cpu").encode(images, "model")
    rows = out.to_pylist()
    for row in rows[:5]:
        assert row["error"] is None and rel_err(torch.tensor(row["embedding"]), ref[row["id"]]) <= 1e-5
    assert rows[5]["embedding"] is None and "ImageDecodeError" in rows[5]["error"]
    tokens = EncoderActor("tiny-clip", pooling="none", buckets="256,512", preprocess_config=pp)(decoded)
    assert tokens.column("grid_h").to_pylist()[:5] == [8] * 5 and len(tokens.column("embedding")[0]) == 64
