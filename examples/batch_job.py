"""Embed a Parquet file of images with Ray Data: `python examples/batch_job.py [--num-images N]`.

Generates a small Parquet file of random PNG/JPEG images in a temporary directory, embeds it with
`deployments.batch.embed_dataset` (the embedded random-weight `tiny` preset; CPU or GPU) and
writes the result as Parquet. The same job as a resumable command:

    python -m deployments.batch --input images.parquet --output embeddings/
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from deployments.batch import embed_dataset  # noqa: E402


def make_parquet(path: Path, num_images: int, seed: int = 0) -> None:
    """`id`, `image` (encoded bytes) and `caption` columns; images of mixed sizes, random content."""
    rng = np.random.default_rng(seed)
    images = []
    for i in range(num_images):
        h, w = (int(v) for v in rng.integers(32, 160, 2))
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG" if i % 2 else "JPEG")
        images.append(buf.getvalue())
    table = pa.table(
        {
            "id": np.arange(num_images),
            "image": pa.array(images, pa.binary()),
            "caption": [f"image {i}" for i in range(num_images)],
        }
    )
    pq.write_table(table, path)


def main(num_images: int = 64, model: str = "tiny", address: str | None = None) -> pa.Table:
    import ray
    import ray.data

    if not ray.is_initialized():
        # Ray's workers import deployments.batch too: make this checkout importable for them
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        # "local": a Ray instance of our own; a bare ray.init() would join any cluster `ray start` started on
        # this machine. An address joins that cluster (RAY_AUTH_MODE=token to send its token). Quiet, as the
        # batch CLI: no token-authentication notice (authentication stays on), Ray's WARNING lines and above.
        from deployments.ray_compat import quiet_token_auth_notice

        quiet_token_auth_notice()
        ray.init(address=address or "local", logging_level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "images.parquet"
        make_parquet(src, num_images)
        # Ray 2.60's default Parquet reader (datasource V2) starts 32 `FooterReader` actors, each a new process,
        # every time a dataset read from Parquet runs: ~12 s per run on a 2-core machine, against 0.3 s for the
        # V1 reader that this switch (public, in `DataContext`) keeps. Set it before the read (a dataset keeps
        # the context it was created with); the caller's own setting is restored once the job ran.
        # Ray Data's progress bars count blocks per operator; this script prints its own summary.
        context = ray.data.DataContext.get_current()
        callers_v2, context.use_datasource_v2 = context.use_datasource_v2, False
        callers_bars, context.enable_progress_bars = context.enable_progress_bars, False
        try:
            ds = ray.data.read_parquet(str(src))
            embedded = embed_dataset(ds, model=model, image_column="image", pooling="mean")
            embedded.write_parquet(str(Path(tmp) / "embeddings"))
        finally:
            context.use_datasource_v2, context.enable_progress_bars = callers_v2, callers_bars
        table = pa.concat_tables([pq.read_table(p) for p in sorted((Path(tmp) / "embeddings").glob("*.parquet"))])
    table = table.sort_by("id")
    dim = table.schema.field("embedding").type.list_size
    error_rows = table.num_rows - table.column("error").null_count
    print(f"{table.num_rows} rows, embedding dim {dim}, {error_rows} error rows")
    for row in table.slice(0, 3).to_pylist():
        print(f"  id {row['id']}: {row['caption']!r}, embedding[:4] = {[round(v, 4) for v in row['embedding'][:4]]}")
    return table


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-images", type=int, default=64)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--address", default=None, help="Ray cluster to run on (default: a Ray instance of our own)")
    args = parser.parse_args()
    import ray.data  # noqa: F401 - sets up Ray Data's loggers: quieter levels go after it

    # Ray Data's INFO lines (each dataset's execution plan and progress) are not printed here, nor its note that
    # the progress bars are off (as in `python -m deployments.batch`)
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    main(args.num_images, args.model, args.address)
