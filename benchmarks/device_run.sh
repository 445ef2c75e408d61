#!/usr/bin/env bash
# One device call: GPU tests, attention and engine benchmarks, a kernel profile. Results in $OUT.
# Usage on the GPU machine: bash benchmarks/device_run.sh [tests|bench|profile ...]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
steps=${*:-tests bench profile}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> "$OUT/gpu.txt" 2>&1
for s in $steps; do
  case $s in
    tests) timeout 420 python3 -m pytest -q -m gpu -x tests/test_attention.py tests/test_gpu_engine.py tests/test_preprocess.py -p no:cacheprovider 2>&1 | tail -40 > "$OUT/gpu_tests.txt" ;;
    attn) timeout 120 python3 benchmarks/attention.py --check > "$OUT/attention.md" 2>&1 ;;
    bench) timeout 400 python3 benchmarks/engine.py --json "$OUT/engine.json" > "$OUT/engine.md" 2>&1 ;;
    profile) timeout 120 python3 benchmarks/profile_engine.py > "$OUT/profile.txt" 2>&1 ;;
  esac
  echo "step $s rc=$?" >> "$OUT/gpu.txt"
done
cat "$OUT/gpu.txt"
