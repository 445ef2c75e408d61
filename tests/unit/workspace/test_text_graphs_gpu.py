"""The text graphs on the GPU (tiny CLIP and SigLIP2 checkpoints): replay == the eager text encoder on random
batches of random texts at several batch sizes, with the static outputs poisoned before every call; image and text
graphs interleaved in their shared pool; `text_graphs=False`; a text-only engine (`images=False`) and the async path."""

from __future__ import annotations

import random

import pytest
import torch

import encoder
import workspace
from tests.graph_cases import random_batch, rel_err
from tests.text_checkpoints import write_clip, write_siglip

pytestmark = pytest.mark.gpu

WORDS = ["a", "photo", "of", "the", "cat", "dog", "on", "red", "blue", "car", "Tokyo", "façade", "😀", "is", "big"]
SIZES = [1, 3, 8, 37, 256, 300]  # 300: a chunk of 256 and one of 44 (in the 64-text graphs)


def random_texts(n: int, rng: random.Random, short: bool = False) -> list[str]:
    """`n` texts of 1 to 20 words, short and long (truncated) mixed in a batch; `short`: one word of a few tokens
    each (a batch CLIP runs in its 8-column graphs: the tiny vocabulary spells most words letter by letter)."""
    if short:
        return [rng.choice(["a", "cat", "on", "of"]) for _ in range(n)]
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 2, 3, 5, 8, 20]))) for _ in range(n)]


@pytest.fixture(scope="module", params=["clip", "siglip2"])
def checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "clip":
        write_clip(directory)
    else:
        write_siglip(directory, "siglip2")
    return directory


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def pair(checkpoint, request):
    enc = encoder.load(checkpoint, device="cuda", dtype=request.param)
    return enc, workspace.GraphEncoder(enc, buckets="64,256", debug=True)


def poison(graph: workspace.GraphEncoder) -> None:
    """NaN in every text graph's static output: what a replay does not write shows."""
    with torch.inference_mode():  # written during capture, under it
        for ws in graph.text_runner.workspaces.values():
            ws.out.fill_(float("nan"))


def test_graphs_captured_in_the_image_pool(pair):
    enc, graph = pair
    runner = graph.text_runner
    assert runner.use_graphs and len(runner.graphs) == len(runner.table) == runner.stats.captures
    assert runner.pool is graph.runner.pool is not None and runner.lock is graph.runner.lock
    seq_len = enc.text.config.seq_len
    assert runner.table.seqs == ((8, seq_len) if enc.text.tower.prefix_exact else (seq_len,))
    assert graph.stats()["text"]["capture_seconds"] > 0


def test_replay_equals_eager_on_random_texts(pair):
    enc, graph = pair
    rng = random.Random(0)
    tol = 1e-4 if enc.dtype == torch.float32 else 2e-2  # shorter graphs (CLIP) run other kernel shapes: rounding
    for case, n in enumerate(SIZES * 2):
        texts = random_texts(n, rng, short=case >= len(SIZES))  # the second round: short texts only
        poison(graph)
        got = torch.stack(graph.encode_text(texts, pooling="model" if case % 2 else "model-l2"))
        want = torch.stack(enc.encode_text(texts, pooling="model" if case % 2 else "model-l2"))
        assert got.shape == want.shape and got.dtype == torch.float32
        assert torch.isfinite(got).all(), n
        assert rel_err(got, want) <= tol, (n, rel_err(got, want))
        assert got.abs().amax() > 0  # not the zeros of a buffer nobody wrote
    stats = graph.stats()["text"]
    assert stats["eager_runs"] == 0 and sum(stats["replays"].values()) >= len(SIZES) * 2
    if enc.text.tower.prefix_exact:  # short texts ran in shorter graphs
        assert any(key.endswith("x8") for key in stats["replays"])


def test_encode_text_ids_replays_the_same(pair):
    enc, graph = pair
    texts = random_texts(20, random.Random(1))
    ids, mask = enc.text.tokenize(texts)
    poison(graph)
    assert all(
        torch.equal(a, b) for a, b in zip(graph.encode_text_ids(ids, mask), graph.encode_text(texts), strict=True)
    )
    on_device = graph.encode_text_ids(ids.cuda(), mask.cuda())  # pre-tokenized input already on the GPU
    assert all(torch.equal(a, b) for a, b in zip(on_device, graph.encode_text(texts), strict=True))


def test_image_and_text_graphs_interleaved(pair):
    """One pool for both: image outputs are the same before and after text replays, and text outputs the same
    before and after image replays."""
    enc, graph = pair
    batch = random_batch([[1, 4, 4], [1, 4, 4]], enc.config.patch_dim, seed=2)
    texts = random_texts(12, random.Random(2))
    images = graph.encode(batch)
    text = graph.encode_text(texts)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(graph.encode_text(texts), text, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(graph.encode(batch), images, strict=True))


def test_text_graphs_can_be_skipped(checkpoint):
    enc = encoder.load(checkpoint, device="cuda", dtype="float32")
    graph = workspace.GraphEncoder(enc, buckets="64", text_graphs=False)
    assert not graph.text_runner.graphs and graph.stats()["text"]["captures"] == 0
    texts = random_texts(9, random.Random(3))
    got, want = torch.stack(graph.encode_text(texts)), torch.stack(enc.encode_text(texts))
    assert rel_err(got, want) <= 1e-5


def test_a_text_only_engine_captures_the_text_graphs_alone(pair):
    """`images=False`: the text table's graphs in a pool of their own, no image graphs; equal to the eager
    encoder as the full engine is; async results bit-equal to the sync ones, the static outputs poisoned between
    the call and its result (the pending copy was queued before)."""
    enc, full = pair
    graph = workspace.GraphEncoder(enc, images=False, debug=True)
    runner = graph.text_runner
    assert graph.runner is None and runner.pool is not None and runner.pool is not full.runner.pool
    assert runner.use_graphs and len(runner.graphs) == len(runner.table) == runner.stats.captures
    assert "captures" not in graph.stats()  # no image counters: nothing captured for images
    texts = random_texts(37, random.Random(5))
    tol = 1e-4 if enc.dtype == torch.float32 else 2e-2  # as test_replay_equals_eager_on_random_texts
    want = graph.encode_text(texts)
    assert rel_err(torch.stack(want), torch.stack(enc.encode_text(texts))) <= tol
    ids, mask = enc.text.tokenize(texts)
    pending = graph.encode_text_ids_async(ids, mask)
    poison(graph)
    assert all(torch.equal(a, b) for a, b in zip(pending.result(), want, strict=True))
