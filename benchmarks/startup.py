"""Start-up cost of one GPU replica's engine: model load, then `GraphEncoder` (fuse, capture of every
graph shape of the default table, kernel compilation included). Prints one JSON line.

Run twice with FA4's persistent compile cache on to see what a restart saves:
    FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache \
        python -m benchmarks.startup --model qwen2.5-vl-7b --attention fa4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import encoder
import workspace
from benchmarks.common import require_cuda


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-vl-7b")
    parser.add_argument("--attention", default="auto")
    args = parser.parse_args(argv)
    if not require_cuda("benchmarks.startup"):
        return 2
    t0 = time.perf_counter()
    enc = encoder.load(args.model, device="cuda", dtype=torch.bfloat16, attention=args.attention)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    graph = workspace.GraphEncoder(enc)
    t2 = time.perf_counter()
    stats = graph.stats()
    row = dict(model=args.model, attention=args.attention, load_s=round(t1 - t0, 2), engine_s=round(t2 - t1, 2),
               captures=stats["captures"], capture_s=stats["capture_seconds"],
               capture_gib=round(stats["capture_bytes"] / 2**30, 2), chosen=stats["attention"],
               fa4_cache=os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0"))  # fmt: skip
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
