"""The batch job's encoder actors without Ray, on a tiny CLIP checkpoint with its tokenizer: the text actor builds a
text-only engine (no image table or graphs) whose largest text graph is the rows per text batch the driver sizes
by (`texts.text_rows_per_batch`), refuses a driver that sized for another, and embeds as `encode_text` does; the
image actor loads no text side. Whole jobs: tests/integration/batch/test_batch_text.py."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import encoder
from deployments.batch.actor import EncoderActor
from deployments.batch.text_actor import TextEncoderActor
from deployments.batch.texts import text_rows_per_batch
from encoder.errors import InvalidArgumentError
from tests.text_checkpoints import write_clip
from workspace.text_buckets import MAX_GRAPH_TEXTS


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("clip-actor")
    write_clip(directory)
    return str(directory)


def test_the_text_actor_is_text_only_and_batches_by_its_engines_largest_graph(clip_dir):
    rows = text_rows_per_batch()
    actor = TextEncoderActor(clip_dir, "caption", dtype="float32", expected_text_batch=rows)
    assert actor.engine.runner is None and actor.engine.table is None  # no image buckets captured
    assert actor.engine.max_text_batch == rows == MAX_GRAPH_TEXTS
    texts = ["a red bicycle", None, "Ünïcode 東京 😀", "", "cat " * 40]
    out = actor(pa.table({"id": list(range(5)), "caption": pa.array(texts, pa.string())}))
    assert out.column_names == ["id", "embedding", "error"]
    assert out.column("error").to_pylist() == [
        None, "InvalidArgumentError: text is null", None, "InvalidArgumentError: text is an empty string", None,
    ]  # fmt: skip
    got = out.column("embedding").to_pylist()
    want = encoder.load(clip_dir, device="cpu", dtype="float32").encode_text([texts[0], texts[2], texts[4]])
    for row, w in zip((0, 2, 4), want, strict=True):
        assert float(np.abs(w.numpy()).max()) > 0
        np.testing.assert_allclose(np.asarray(got[row], np.float32), w.numpy(), rtol=1e-5, atol=1e-6)
    assert got[1] is None and got[3] is None
    with pytest.raises(InvalidArgumentError, match=f"sized text batches for 100 texts a graph, but this actor's "
                                                   f"engine holds {MAX_GRAPH_TEXTS}"):  # fmt: skip
        TextEncoderActor(clip_dir, "caption", dtype="float32", expected_text_batch=100)


def test_the_image_actor_loads_no_text_side(clip_dir):
    actor = EncoderActor(clip_dir, pooling="model", dtype="float32")
    assert not actor.vision.supports_text and actor.engine.text_runner is None
    assert actor.engine.max_text_batch is None and actor.engine.runner is not None
