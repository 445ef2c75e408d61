"""Encode images from the command line: `python -m encoder IMAGE [IMAGE ...] [--output FILE|-]`.

Without --output: one short JSON line per image (patch grid, shape, the first 8 values). With it,
every value (`encoder.embedding_output`): FILE.npy (pooled vectors, [images, dim]), FILE.parquet
(one row per image), or - (JSON Lines on stdout). --model takes a preset, a checkpoint directory
or a Hugging Face Hub id (org/name[@revision]). An image that cannot be read or encoded is reported on
stderr (one `error: FILE: ...` line each) and left out; the others are encoded and written.
Exit status: 0 done, 1 some images failed (the others written), 2 bad arguments, model or output, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from encoder.embedding_output import STDOUT, ImageEmbedding, check_output, write
from encoder.errors import EncoderError, InvalidArgumentError, RandomWeightsWarning, reason
from encoder.loading.hub import resolve_model
from encoder.poolings import POOLINGS
from encoder.preprocessing.images import harden_pillow

if TYPE_CHECKING:
    from encoder import PatchBatch, VisionEncoder

SHORT_VALUES = 8  # values of each embedding in the default print


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m encoder", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("images", nargs="+", type=Path, help="image files (PNG, JPEG, WebP, GIF, BMP, TIFF)")
    parser.add_argument("--model", default="tiny", help="preset, checkpoint directory or Hub id org/name[@rev]")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    parser.add_argument("--attention", default=None, help="attention backend (default: sdpa on CPU)")
    parser.add_argument(
        "--pooling", default=None, choices=POOLINGS,
        help="default: the model's own embedding (CLIP, SigLIP) or the token mean (Qwen)",
    )  # fmt: skip
    parser.add_argument("--output", default=None, help="FILE.npy, FILE.parquet, or - for JSON Lines on stdout")
    return parser.parse_args(argv)


def report(path: Path, exc: Exception) -> None:
    """One stderr line for an image left out, naming its file."""
    print(f"error: {image_name(path)}: {exc}", file=sys.stderr)


def read_files(paths: list[Path]) -> tuple[list[Path], list[bytes]]:
    """The files that can be read, with their bytes, before the model is loaded; each other one reported."""
    good, data = [], []
    for path in paths:
        try:
            data.append(path.read_bytes())
            good.append(path)
        except OSError as exc:
            report(path, InvalidArgumentError(f"cannot read ({exc.strerror or reason(exc)})"))
    return good, data


def image_name(path: Path) -> str:
    """The path as given, as text JSON and Parquet can hold: the bytes of a name that is not UTF-8 (a Latin-1
    `caf\\xe9.png`) as `\\xNN` escapes, not the lone surrogates Python decodes them to, which orjson and pyarrow
    refuse with a traceback."""
    return str(path).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def preprocess_files(enc: VisionEncoder, paths: list[Path], data: list[bytes]) -> tuple[list[Path], PatchBatch | None]:
    """Each image preprocessed on its own, so an error names its file and leaves the others in: the files that
    preprocessed and their batch (None when none did)."""
    good, batches = [], []
    for path, item in zip(paths, data, strict=True):
        try:
            batches.append(enc.preprocess([item]))
            good.append(path)
        except EncoderError as exc:
            report(path, exc)
    from encoder.patch_batch import PatchBatch

    return good, PatchBatch.concat(batches) if batches else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    harden_pillow()  # the service's Pillow limits: an image over ours is one `error:` line, not a warning too
    try:
        if args.output is not None:  # before the model loads; the pooling is checked again once known
            check_output(args.output, args.pooling)
        paths, data = read_files(args.images)
        if not paths:
            return 1  # every file was reported; no model to load
        source = resolve_model(args.model)  # a bad model fails here, before torch is imported (~3 s)
        from encoder.api import load, vector_pooling

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RandomWeightsWarning)
            enc = load(source, device=args.device, dtype=args.dtype, attention=args.attention)
        for w in caught:  # a plain line, not the file:line form warnings print
            print(f"warning: {w.message}", file=sys.stderr)
        pooling = args.pooling or vector_pooling(enc.config)
        if args.output is not None:
            check_output(args.output, pooling)
        paths, batch = preprocess_files(enc, paths, data)
        if batch is None:
            return 1
        start = time.perf_counter()
        outs = enc.encode(batch, pooling=pooling)
        elapsed = time.perf_counter() - start
    except EncoderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    grids = [tuple(g) for g in batch.grid_thw.tolist()]
    results = [ImageEmbedding(image_name(p), g, o.numpy()) for p, g, o in zip(paths, grids, outs, strict=True)]
    try:
        if args.output is None:
            for r in results:
                head = [round(v, 6) for v in r.embedding.reshape(-1)[:SHORT_VALUES].tolist()]
                short = dict(image=r.image, grid_thw=list(r.grid_thw), shape=list(r.embedding.shape), embedding=head)
                print(json.dumps(short), flush=True)
        else:
            write(results, args.output, sys.stdout.buffer)
    except OSError as exc:
        if isinstance(exc, BrokenPipeError):  # `... | head`: the reader is gone. Point stdout at /dev/null so
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit cannot fail again
        print(f"error: {args.output or 'stdout'}: cannot write ({exc.strerror or reason(exc)})", file=sys.stderr)
        return 2
    wrote = "" if args.output in (None, STDOUT) else f", wrote {args.output}"
    failed = len(args.images) - len(paths)
    print(
        f"{len(outs)} images, {enc.name} on {enc.device} ({enc.dtype}), pooling {pooling}, "
        f"{elapsed * 1e3:.1f} ms{wrote}" + (f"; {failed} failed (above)" if failed else ""),
        file=sys.stderr,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
