"""Batch job throughput against the engine alone, in one process (issue 5's acceptance benchmark).

1. Generates a Parquet file of N random 224x224 JPEGs (smooth random colour fields plus noise, so
   decode costs what a photo's does), in parallel.
2. Engine only: a `GraphEncoder` (graphs captured as in the service) on the same images, decoded,
   resized and patchified beforehand and already on the device; batches of the job's encoder batch
   size; img/s over repeated passes.
3. End to end: `deployments.batch.run_job` on the Parquet file (read, decode and resize on CPU tasks,
   encoder actor(s) with one GPU each, Parquet parts written), once per configuration
   (encoder batch rows x decode concurrency). Reported two ways: over the whole run (actor start-up
   and graph capture included) and after the first 10% of the rows are back (the steady rate, which more
   images converge to).

    python -m benchmarks.batch                                   # qwen2.5-vl-7b on the GPU, 20000 images
    python -m benchmarks.batch --batch-sizes auto,128 --decode-concurrency 8,14
    python -m benchmarks.batch --model tiny --num-images 200     # CPU smoke run

Prints a markdown table (and writes it to --markdown when given).
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

import encoder
from deployments.batch import JobConfig, run_job
from deployments.batch.model_facts import plan_for_actors, preprocess_config_for, rows_per_batch
from encoder.patchify import patchify_many
from encoder.preprocessing.images import load_image  # noqa: E402
from encoder.preprocessing.qwen import num_patches, resize_image  # noqa: E402
from workspace import GraphEncoder  # noqa: E402

# ------------------------------------------------------------------------------------- data


def make_jpeg(args: tuple[int, int]) -> bytes:
    seed, size = args
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).resize((size, size), Image.BICUBIC)
    pixels = np.asarray(coarse, dtype=np.float32) + rng.normal(0, 12, (size, size, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def decode_resize(data: bytes) -> np.ndarray:
    pp = _POOL_PP
    return resize_image(load_image(data, pp), pp)


_POOL_PP = None


def _init_pool(pp) -> None:
    global _POOL_PP
    _POOL_PP = pp


def write_dataset(path: Path, num_images: int, size: int, procs: int, row_group: int = 2000) -> list[bytes]:
    with mp.get_context("spawn").Pool(procs) as pool:
        images = pool.map(make_jpeg, [(i, size) for i in range(num_images)], chunksize=64)
    table = pa.table({"id": np.arange(num_images), "image": pa.array(images, pa.binary())})
    pq.write_table(table, path, row_group_size=row_group)
    return images


# ------------------------------------------------------------------------------------- engine only


def engine_only(model, images, pp, buckets, rows, dtype, attention, procs, min_seconds, pooling) -> dict:
    with mp.get_context("spawn").Pool(procs, initializer=_init_pool, initargs=(pp,)) as pool:
        arrays = pool.map(decode_resize, images, chunksize=32)
    vision = encoder.load(model, dtype=dtype, attention=attention)
    if vision.device.type == "cpu":
        torch.set_num_threads(1)  # as the job's CPU actor (Ray gives it OMP_NUM_THREADS = its 1 CPU)
    start = time.perf_counter()
    engine = GraphEncoder(vision, buckets)
    setup = time.perf_counter() - start
    device = vision.device
    batches = []
    for i in range(0, len(arrays), rows):
        chunk = [torch.from_numpy(a).to(device) for a in arrays[i : i + rows]]
        batches.append(patchify_many(chunk, pp))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    engine.encode(batches[0], pooling=pooling)  # warm-up
    sync()
    done, passes = 0, 0
    start = time.perf_counter()
    while True:
        for batch in batches:
            engine.encode(batch, pooling=pooling)
            done += batch.num_images
        passes += 1
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            break
    stats = engine.stats()
    del engine, vision, batches
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "images": done,
        "seconds": elapsed,
        "img_s": done / elapsed,
        "setup_s": setup,
        "passes": passes,
        "device": str(device),
        "stats": stats,
    }


# ------------------------------------------------------------------------------------- main


def parse_list(text: str, auto_ok: bool = True) -> list[int | None]:
    out = []
    for tok in text.split(","):
        tok = tok.strip()
        out.append(None if auto_ok and tok in ("auto", "default", "") else int(tok))
    return out


def export_preset(name: str, directory: Path) -> str:
    """Write a random-weight preset as a Hugging Face checkpoint directory (vision weights under
    `visual.`, the patch embedding as the Conv3d it is in real checkpoints, bf16 safetensors)."""
    import json

    from safetensors.torch import save_file

    import encoder

    enc = encoder.load(name, device="cpu", dtype=torch.float32)
    cfg = enc.config
    directory.mkdir(parents=True, exist_ok=True)
    vision = {k: v for k, v in cfg.model_dump().items() if k != "family"}
    vision["model_type"] = cfg.family
    (directory / "config.json").write_text(json.dumps({"model_type": cfg.family, "vision_config": vision}))
    state = {}
    for key, value in enc.model.state_dict().items():
        if key == "patch_embed.proj.weight":
            value = value.view(cfg.width, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        state[f"visual.{key}"] = value.to(torch.bfloat16).contiguous()
    save_file(state, str(directory / "model.safetensors"))
    return str(directory)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    has_gpu = torch.cuda.is_available()
    p.add_argument("--model", default="qwen2.5-vl-7b" if has_gpu else "tiny")
    p.add_argument("--num-images", type=int, default=20000)
    p.add_argument("--size", type=int, default=224, help="image side in pixels")
    p.add_argument("--pooling", default="mean", choices=["mean", "none"])
    p.add_argument("--dtype", default=None)
    p.add_argument("--attention", default=None)
    p.add_argument("--buckets", default=None, help="bucket spec (default: the service's; CPU: small buckets)")
    p.add_argument("--batch-sizes", default="auto", help="encoder batch rows to try, e.g. 'auto,128,256'")
    p.add_argument("--decode-concurrency", default="auto", help="max decode tasks to try, e.g. 'auto,8,14'")
    p.add_argument("--decode-batch-size", type=int, default=32, help="rows per decode task")
    p.add_argument("--part-rows", type=int, default=None, help="rows per output part (default: the job's)")
    p.add_argument("--num-gpus", type=int, default=None, help="GPU actors (default: all GPUs)")
    p.add_argument("--engine-images", type=int, default=2048, help="images in the engine-only loop")
    p.add_argument("--engine-seconds", type=float, default=10.0, help="minimum engine-only timing")
    p.add_argument("--procs", type=int, default=os.cpu_count(), help="processes for data generation")
    p.add_argument("--workdir", default=None, help="where the data and outputs go (default: a temp dir)")
    p.add_argument("--markdown", default=None, help="also write the table to this file")
    p.add_argument(
        "--as-checkpoint",
        action="store_true",
        help="export a preset to a local HF checkpoint (bf16 safetensors) first and run from it, as users do; "
        "actors then load weights instead of generating ~680M random numbers on the CPU",
    )
    args = p.parse_args(argv)

    import ray

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="batch-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    src = workdir / "images.parquet"
    t0 = time.perf_counter()
    images = write_dataset(src, args.num_images, args.size, args.procs)
    print(
        f"generated {len(images)} JPEGs ({src.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )

    if args.as_checkpoint and not Path(args.model).is_dir():
        t0 = time.perf_counter()
        args.model = export_preset(args.model, workdir / "checkpoint")
        print(f"exported the preset to {args.model} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    pp = preprocess_config_for(args.model)
    gpus = (1 if has_gpu else 0) if args.num_gpus is None else args.num_gpus
    plan = plan_for_actors(args.model, gpus, args.buckets, args.dtype, args.attention)
    typical = num_patches(args.size, args.size, pp)
    auto_rows = rows_per_batch(plan, typical)
    batch_sizes = [b or auto_rows for b in parse_list(args.batch_sizes)]

    eng = engine_only(
        args.model,
        images[: args.engine_images],
        pp,
        plan.table,
        batch_sizes[0],
        args.dtype,
        args.attention,
        args.procs,
        args.engine_seconds,
        args.pooling,
    )
    print(
        f"engine only: {eng['img_s']:.1f} img/s on {eng['device']} ({eng['setup_s']:.1f} s to capture), "
        f"stats {eng['stats']}",
        file=sys.stderr,
    )

    if not ray.is_initialized():
        # Ray's workers import deployments.batch: make the checkout importable wherever this runs from
        root = str(Path(__file__).resolve().parents[1])
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        ray.init()
    resources = ray.cluster_resources()
    rows = []
    for bs in batch_sizes:
        for dc in parse_list(args.decode_concurrency):
            out = workdir / f"out-b{bs}-d{dc or 'auto'}"
            shutil.rmtree(out, ignore_errors=True)
            summary = run_job(
                JobConfig(
                    input=[str(src)],
                    output=str(out),
                    model=args.model,
                    pooling=args.pooling,
                    dtype=args.dtype,
                    attention=args.attention,
                    buckets=args.buckets,
                    batch_size=bs,
                    part_rows=args.part_rows,
                    decode_batch_size=args.decode_batch_size,
                    decode_concurrency=dc,
                    num_gpus=args.num_gpus,
                    progress=False,
                )
            )
            assert summary.complete and summary.rows == args.num_images, summary
            rows.append((bs, dc, summary))

    gpu_name = torch.cuda.get_device_name(0) if has_gpu else "none"
    lines = [
        f"Batch job vs engine: {args.model} ({args.dtype or 'default dtype'}), {args.num_images} x {args.size}² JPEG, "
        f"pooling={args.pooling}, buckets={args.buckets or 'default'}; GPU {gpu_name}, Ray sees "
        f"{resources.get('CPU', 0):g} CPU / {resources.get('GPU', 0):g} GPU",
        "",
        "| run | encoder batch rows | decode tasks | images | seconds | img/s | img/s after first 10% | vs engine |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| engine only ({eng['device']}, pre-patchified on device) | {batch_sizes[0]} | - | {eng['images']} | "
        f"{eng['seconds']:.1f} | {eng['img_s']:.1f} | {eng['img_s']:.1f} | 100% |",
    ]
    for bs, dc, s in rows:
        lines.append(
            f"| end to end (decode included) | {bs} | {dc or 'auto'} | {s.rows} | {s.seconds:.1f} | "
            f"{s.images_per_second:.1f} | {s.steady_images_per_second:.1f} "
            f"(first rows at {s.first_batch_seconds:.1f} s) | "
            f"{100 * s.images_per_second / eng['img_s']:.0f}% "
            f"({100 * s.steady_images_per_second / eng['img_s']:.0f}% after first 10%) |"
        )
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
