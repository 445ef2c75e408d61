"""`examples/search.py` (docs/search.md) against a running service of a tiny CLIPModel checkpoint with its tokenizer
(`tests/text_checkpoints.py`): the batch job embeds a folder of images, the service embeds text (and image) queries,
and the ranking equals the cosines of `encoder.load`'s own image and text embeddings."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

import encoder
from tests.images_util import encode, random_image
from tests.serve_fixtures import running_app
from tests.text_checkpoints import write_clip

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("clip-search")
    write_clip(directory)
    return directory


@pytest.fixture(scope="module")
def service(ray_cluster, clip_dir):
    from deployments import build_app

    with running_app(build_app({"model": str(clip_dir), "num_replicas": 1, "dtype": "float32"}), name="search") as svc:
        yield svc


def test_search_example_ranks_by_the_models_own_cosines(service, clip_dir, tmp_path):
    spec = importlib.util.spec_from_file_location("example_search", EXAMPLES / "search.py")
    search = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(search)
    photos = tmp_path / "photos"
    (photos / "more").mkdir(parents=True)
    shutil.copy(EXAMPLES / "images" / "gradient.jpg", photos / "gradient.jpg")
    for i in range(5):
        (photos / ("more" if i % 2 else ".") / f"img{i}.png").write_bytes(
            encode(random_image("RGB", 40 + 15 * i, 80 - 7 * i, seed=i), "PNG")
        )
    (photos / "notes.txt").write_text("not an image")  # not picked up
    queries = ["a photo of a cat", "a red bicycle", str(photos / "img2.png")]
    results = search.main(service.base_url, photos, str(clip_dir), queries, top_k=6)

    ref = encoder.load(clip_dir, device="cpu", dtype="float32")
    paths = sorted(str(p.resolve()) for p in photos.rglob("*") if p.suffix in (".jpg", ".png"))
    images = ref.encode([Path(p).read_bytes() for p in paths], pooling="model-l2")
    want_vectors = [*ref.encode_text(queries[:2], pooling="model-l2"), images[paths.index(queries[2])]]
    image_matrix = np.stack([v.numpy() for v in images])
    for q, vec in zip(queries, want_vectors, strict=True):
        cosines = image_matrix @ vec.numpy()
        order = np.argsort(-cosines, kind="stable")
        got = results[q]
        assert len(got) == 6
        np.testing.assert_allclose([s for _, s in got], cosines[order], atol=1e-4)
        # the same ranking (ties within the tolerance may swap)
        for (path, score), i in zip(got, order, strict=True):
            assert path == paths[i] or abs(score - cosines[i]) < 1e-4
    assert results[queries[2]][0] == (queries[2], pytest.approx(1.0, abs=1e-4))  # an image finds itself
