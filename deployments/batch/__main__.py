"""Embed the images (or, with --text-column, the texts) of Parquet / Arrow IPC files:
`python -m deployments.batch --input PATH --output DIR`.

Output: Parquet parts in DIR with every non-image input column, `embedding` and `error` (see
README "Batch jobs"), plus DIR/_manifest.json. Re-running the same command resumes: finished
parts are skipped. --model takes a preset, a checkpoint directory or a Hugging Face Hub id
(org/name[@revision]). An image that cannot be read or decoded, or a null or empty text, is an error row (its
`error` column), not a failed job.

Exit status:
  0    the job is complete
  1    it ended with parts missing (re-run the same command to resume)
  2    bad arguments, inputs or model (one `error:` line, before Ray starts)
  3    the output cannot be written (disk full, quota, read-only, permission): one `error:` line naming the
       file and the cause; finished parts are kept, re-run to resume
  130  interrupted (Ctrl-C); finished parts are kept, re-run to resume
"""

from __future__ import annotations

import argparse
import errno
import sys

from pydantic import ValidationError

from deployments.batch.job import run_job
from deployments.batch.manifest import OutputWriteError
from deployments.batch.options import JobConfig, invalid
from encoder.errors import EncoderError
from encoder.poolings import POOLINGS
from encoder.preprocessing.images import harden_pillow
from workspace.buckets import BucketError


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> JobConfig:
    p = argparse.ArgumentParser(
        prog="python -m deployments.batch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--input", required=True, nargs="+", help="Parquet / Arrow IPC files or directories")
    p.add_argument("--output", required=True, help="output directory (created; holds parts and the manifest)")
    p.add_argument("--image-column", default="image", help="binary (encoded images) or string (local paths)")
    p.add_argument(
        "--text-column",
        default=None,
        help="embed this string column with the model's text tower instead of images (CLIP / SigLIP2 checkpoints "
        "with their tokenizer files; --pooling model or model-l2); a null or empty text is an error row",
    )
    p.add_argument(
        "--video-column",
        default=None,
        help="embed this column's videos instead of images (Qwen towers): binary (encoded MP4 / WebM / AVI...) or "
        "string (local paths); a bad video is an error row",
    )
    p.add_argument("--id-column", default="id", help="column naming rows in the summary (default: id, if present)")
    p.add_argument("--model", default="tiny", help="preset, checkpoint directory or Hub id org/name[@rev]")
    p.add_argument(
        "--pooling",
        default=None,
        choices=list(POOLINGS),
        help="model: the model's own embedding (CLIP / SigLIP); mean: mean of the output tokens; none: every "
        "token; -l2: L2-normalised (default: model for CLIP / SigLIP, mean otherwise)",
    )
    p.add_argument(
        "--layout",
        default="parts",
        choices=["parts", "vllm"],
        help="per-token outputs of Qwen towers: parts (embedding and deepstack columns apart; default) or vllm "
        "(embedding = vLLM's one tensor per image, the tokens then each DeepStack layer on the last axis); vllm "
        "implies --pooling none",
    )
    p.add_argument(
        "--ec-cache-dir",
        default=None,
        help="write each image's vLLM-layout tensor for vLLM's disk encoder-cache connector as "
        "DIR/<uuid>/encoder_cache.safetensors (key ec_cache; the tower's dtype) instead of an embedding column; "
        "the row's ec_cache column is the path (needs --uuid-column)",
    )
    p.add_argument(
        "--uuid-column", default=None, help="with --ec-cache-dir: the string column of uuids (vLLM's mm_hash)"
    )
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--attention", default=None, help="attention backend (default: the encoder's)")
    p.add_argument(
        "--quantization",
        default=None,
        choices=["fp8"],
        help="fp8: the transformer blocks' linear layers in float8 e4m3, attention and the rest bf16 (GPUs of "
        "compute capability 8.9 or newer; default: none)",
    )
    p.add_argument("--buckets", default=None, help="bucket budgets, e.g. 'pow2:256-32768' (default: the service's)")
    p.add_argument(
        "--batch-size",
        type=_positive,
        default=None,
        help="rows per encoder batch (default: ~2 actor batches of patches at the sampled image size; with "
        "--text-column, the texts one text graph holds)",
    )
    p.add_argument(
        "--part-rows",
        type=_positive,
        default=None,
        help="rows per output part (default: 10000 for one vector per image, 1000 for none)",
    )
    p.add_argument(
        "--max-image-bytes",
        type=_positive,
        default=20 * 2**20,
        help="encoded bytes of one image; a longer file or value is an error row (default: 20 MiB)",
    )
    p.add_argument("--decode-batch-size", type=_positive, default=32, help="rows per CPU decode task")
    p.add_argument("--decode-concurrency", type=_positive, default=None, help="max decode tasks at once")
    p.add_argument(
        "--num-gpus",
        type=_non_negative,
        default=None,
        help="GPU encoder actors, one GPU each (default: all GPUs; 0 = CPU)",
    )
    p.add_argument("--num-actors", type=_positive, default=None, help="CPU encoder actors when there are no GPUs")
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or a local cluster)")
    p.add_argument("--no-progress", action="store_true", help="no progress lines (images done, images/s)")
    a = vars(p.parse_args(argv))
    progress = not a.pop("no_progress")
    a["id_column"] = a["id_column"] or None
    try:
        return JobConfig(**a, progress=progress)
    except ValidationError as e:  # what argparse cannot see alone (`--quantization fp8 --num-gpus 0`): usage, exit 2
        p.error(str(invalid(e, "arguments")))


# what a write into the output directory outside `manifest.writing` can still meet: the same one line, exit 3
_CANNOT_WRITE = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    harden_pillow()  # the driver reads sample headers (text-chunk cap, quiet bombs); a bomb is an error row later
    try:
        summary = run_job(cfg)
    except (EncoderError, BucketError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OutputWriteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except OSError as exc:
        if exc.errno not in _CANNOT_WRITE:
            raise
        print(f"error: cannot write {exc.filename or cfg.output}: {exc.strerror or exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130
    return 0 if summary.complete else 1


if __name__ == "__main__":
    sys.exit(main())
