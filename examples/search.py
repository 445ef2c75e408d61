"""Search a folder of images by text: embed the images with the batch job, then embed text queries over HTTP and
rank the images by cosine similarity (docs/search.md).

    python -m deployments --port 8000 model=openai/clip-vit-base-patch32    # in another terminal
    python examples/search.py --model openai/clip-vit-base-patch32 --images photos/ "a red bicycle" "a cat"

`--model` is the checkpoint the service runs (a CLIP or SigLIP2 checkpoint with its tokenizer files; a preset has
no tokenizer and takes no text): the batch job loads it itself. Image and text embeddings of one model share one
space; `pooling="model-l2"` gives unit vectors on both sides, so a dot product is the cosine.
"""

from __future__ import annotations

import argparse
import base64
import mimetypes
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff"}


def index_images(images: Path, model: str, work: Path) -> pa.Table:
    """The batch job over every image file under `images`: a Parquet file of their paths in, `id`, `path`,
    `embedding` (unit vectors) and `error` out. As a command:
    `python -m deployments.batch --input paths.parquet --output index/ --image-column path --model M
    --pooling model-l2`."""
    from deployments.batch import JobConfig, run_job

    paths = sorted(str(p.resolve()) for p in Path(images).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not paths:
        raise SystemExit(f"no images under {images}")
    # the path column is kept in the output beside the embeddings; the job reads the images from `image`
    table = pa.table({"id": np.arange(len(paths)), "path": paths, "image": paths})
    pq.write_table(table, work / "paths.parquet")
    run_job(
        JobConfig(
            input=[str(work / "paths.parquet")], output=str(work / "index"), model=model, pooling="model-l2",
            progress=False,
        )
    )  # fmt: skip
    index = pq.read_table(work / "index").sort_by("id")
    bad = index.filter(index.column("error").is_valid())
    for row in bad.to_pylist():
        print(f"skipped {row['path']}: {row['error']}")
    return index.filter(index.column("error").is_null())


def embed_queries(base_url: str, queries: list[str]) -> np.ndarray:
    """[queries, dim] unit vectors of text queries from the service (`input_type: "text"`, `pooling: "model-l2"`);
    a query that names an image file is embedded as that image, in the same request."""
    client = OpenAI(base_url=f"{base_url}/v1", api_key="not-checked")
    (model,) = client.models.list().data
    if "text" not in (getattr(model, "input_types", None) or []):
        raise SystemExit(f"the service's model {model.id!r} takes no text (GET /v1/models: input_types)")
    items: list = []
    for q in queries:
        if Path(q).suffix.lower() in IMAGE_SUFFIXES and Path(q).is_file():
            media = mimetypes.guess_type(q)[0] or "image/png"
            items.append({"image": f"data:{media};base64," + base64.b64encode(Path(q).read_bytes()).decode()})
        else:
            items.append(q)  # a plain string: a text, as input_type says
    answer = client.embeddings.create(
        model=model.id, input=items, extra_body={"input_type": "text", "pooling": "model-l2"}
    )
    return np.array([d.embedding for d in answer.data], dtype=np.float32)


def main(base_url: str, images: str | Path, model: str, queries: list[str], top_k: int = 3) -> dict:
    """{query: [(path, cosine), ...] best first} over the images under `images`."""
    with tempfile.TemporaryDirectory() as tmp:
        index = index_images(Path(images), model, Path(tmp))
    vectors = np.array(index.column("embedding").to_pylist(), dtype=np.float32)  # [images, dim], unit rows
    paths = index.column("path").to_pylist()
    scores = embed_queries(base_url, queries) @ vectors.T  # cosines: both sides are unit vectors
    results = {}
    for q, row in zip(queries, scores, strict=True):
        best = np.argsort(-row, kind="stable")[:top_k]
        results[q] = [(paths[i], float(row[i])) for i in best]
        print(f"{q!r}:")
        for path, score in results[q]:
            print(f"  {score:+.3f}  {path}")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("queries", nargs="+", help="texts (or image files) to search with")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--images", required=True, help="a folder of images to search")
    parser.add_argument("--model", required=True, help="the checkpoint the service runs (directory or Hub id)")
    parser.add_argument("--top-k", type=int, default=3)
    args = parser.parse_args()
    main(args.url, args.images, args.model, args.queries, args.top_k)
