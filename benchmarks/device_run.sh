#!/usr/bin/env bash
# One device call: GPU tests and benchmarks, results under $OUT, run from the repository root as
#   bash benchmarks/device_run.sh [step ...]      (no steps: `all`; every script runs as python3 -m benchmarks.<name>)
# Each step's time limit is cut to what is left of BUDGET_S (default 560 s: one 10-minute device call) and a step
# that cannot get MIN_STEP_S (default 45 s) is skipped; $OUT/gpu.txt lists every step with its exit code, seconds
# or "skipped". Steps:
#   all      util tests bench clip startup qwen3 profile attn, in that order (what fits in BUDGET_S runs)
#   util     issue 45's utilisation rows, quickly: benchmarks/engine.py, auto backend, no HF, Qwen3-VL-8B and
#            Qwen2.5-VL-7B at 8x896 and 32x224 (whole-forward FLOP/s against the burst and the sustained peak)
#   utilhf   issue 48's rows with 45's utilisation: benchmarks/engine.py --model qwen3-vl-8b, auto backend (FA4 where
#            installed, else the fallback), 8x896 and 32x224, HF eager beside
#   tests    pytest -m gpu (attention, engine, preprocessing, kernels, CLIP/SigLIP, SigLIP2, DINOv2/v3, text graphs)
#   attn     benchmarks/attention.py --check
#   bench    benchmarks/engine.py (every backend, HF beside); quick: triton only, no HF
#   startup  benchmarks/startup.py (model load, then every graph's capture), qwen2.5-vl-7b, auto
#   qwen3    GPU tests of the Qwen3-VL tower, then benchmarks/engine.py --model qwen3-vl-8b (every backend, HF
#            beside), then the Qwen2.5-VL-7B triton row with HF beside (the no-regression check)
#   profile  benchmarks/profile_engine.py
#   clip     benchmarks/clip.py
#   video    issue 47.1: video preprocessing against transformers' Qwen2VLVideoProcessor / Qwen3VLVideoProcessor
#            (needs torchvision; no PyAV: frames made in the test), then the video model tests where PyAV is there,
#            then the GPU graph == eager tests on random mixes of videos and images
#   videobench  benchmarks/video.py (issue 47: a 64-frame 448x448 video, Qwen3-VL-8B and Qwen2.5-VL-7B, graph
#            replay vs our eager vs HF eager get_video_features, same weights)
#   text     benchmarks/text.py (issue 46: CLIP ViT-L/14's text tower, graph replay vs eager vs HF, 1 and 256 texts)
#   towers   benchmarks/towers.py (issue 46: SigLIP2 so400m NaFlex at 256 and 1024 max patches, DINOv2-L, DINOv3-L;
#            graph replay vs our eager vs HF eager, 1 and 256 images, pooled outputs against HF's)
#   towertests  issue 46's GPU tests alone (part of `tests`): SigLIP2 NaFlex graph == eager on random mixes of sizes,
#            DINOv2/DINOv3 graph == eager, the text graphs
#   batch    benchmarks/batch.py --as-checkpoint (20,000 224x224 JPEGs)
#   batch100k  the same with 100,000 JPEGs (start-up amortised)
#   ckpt     export the qwen2.5-vl-7b preset to /tmp/ckpt-7b (replicas then load it instead of drawing weights)
#   acceptance  benchmarks/service.py as issue 4 measures it: HAProxy/throughput mode, 1 pipelined replica
#            per GPU, then the router comparison (2 replicas x 0.5 GPU)
#   fp8      issue 45.3: the FP8 GPU tests, then bf16, fp8 and fp8 with fast accumulation graph throughput for
#            Qwen2.5-VL-7B and Qwen3-VL-8B at 32x224 and 8x896 (benchmarks/engine.py, no HF)
#   fp8profile  kernel profiles of the FP8 and bf16 Qwen3-VL-8B forwards at 32 x 224² (benchmarks/profile_engine.py)
#   fp8quality  benchmarks/fp8_quality.py (photographs from $PHOTOS, a folder carried along: the GPU box has no
#            scikit-image), then the same with fast accumulation for Qwen2.5-VL-7B, then the Qwen towers with
#            some layers kept bf16 (--keep: the MLP's output GEMM, the first and last blocks)
#   cold     issue 45.2: benchmarks/cold_start.py, 4 starts of README command 1 from a local 7B checkpoint
#            (written first from the preset); needs the Ray pack
#   launcher issue 45.1: README command 1 as a newcomer runs it (python -m deployments, nothing exported) with the 7B
#            preset, fast path with the engine phase beside (needs the Ray pack)
#   launcherdefault  the same with --request-path default, no engine phase
#   service  benchmarks/service.py, HAProxy/throughput mode, 2 replicas per GPU, router comparison
#   service1 the same with 1 replica per GPU, no router comparison
#   servicedefault  2 replicas per GPU through Ray's default request path (Python proxy, actor calls)
#   service1slot    2 replicas per GPU, one merged encoder request in flight per ingress
#   svc-R-S  R replicas per GPU, S merged requests in flight per ingress (no router comparison);
#   svc-R-S-D  the same with D batches in flight per encoder replica (pipeline_depth); SVC_EXTRA: more
#              benchmarks/service.py flags for these steps (e.g. SVC_EXTRA="--gil-switch-interval 0.005")
# Ray/pydantic come from the carried pack: see ../shared/device/pack-ray.sh; wheels the pack lacks (orjson,
# pybase64) are carried in .device/ as well: `for w in .device/*.whl; do python3 -m zipfile -e $w /tmp/site; done`.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-560}; MIN_STEP_S=${MIN_STEP_S:-45}; T0=$(date +%s)
steps=${*:-all}
steps=${steps//all/util tests bench clip startup qwen3 profile attn}
# wheels carried in .device/ (pydantic, orjson, pybase64 where the GPU image lacks them): unpacked once, importable
if compgen -G ".device/*.whl" > /dev/null; then
  for w in .device/*.whl; do python3 -m zipfile -e "$w" /tmp/site > /dev/null; done
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
budget() {  # budget WANT: WANT seconds, or what is left of BUDGET_S if less
  local left=$(( BUDGET_S - ($(date +%s) - T0) ))
  (( left < 1 )) && left=1  # never 0: `timeout 0` would mean no limit
  (( left < $1 )) && echo "$left" || echo "$1"
}
# the Ray pack has no dashboard front end (client/build): every Ray start then waits 60 s for its dashboard to fail
# (FrontendNotFoundError), which a pip-installed Ray never does; an empty front end lets the dashboard start
ray_dir=$(python3 -c "import os, ray; print(os.path.dirname(ray.__file__))" 2>/dev/null)
if [ -n "$ray_dir" ] && [ ! -d "$ray_dir/dashboard/client/build" ]; then
  mkdir -p "$ray_dir/dashboard/client/build/static" && echo "<!doctype html>" > "$ray_dir/dashboard/client/build/index.html"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> "$OUT/gpu.txt" 2>&1
python3 -c "import pydantic" 2>> "$OUT/gpu.txt" || echo "no pydantic: the encoder steps will fail (carry its wheel in .device/)" >> "$OUT/gpu.txt"
for s in $steps; do
  start=$(date +%s)
  if (( $(budget "$MIN_STEP_S") < MIN_STEP_S )); then echo "step $s skipped: budget spent" >> "$OUT/gpu.txt"; continue; fi
  case $s in
    util) for m in qwen3-vl-8b qwen2.5-vl-7b; do
            timeout $(budget 200) python3 -m benchmarks.engine --model $m --backends auto --workloads 8x896,32x224 --no-hf \
              --json "$OUT/util_$m.json" --markdown "$OUT/util_$m.md" > "$OUT/util_$m.log" 2>&1
          done ;;
    utilhf) timeout $(budget 240) python3 -m benchmarks.engine --model qwen3-vl-8b --backends auto --workloads 8x896,32x224 \
              --json "$OUT/utilhf_qwen3.json" --markdown "$OUT/utilhf_qwen3.md" > "$OUT/utilhf_qwen3.log" 2>&1 ;;
    startup) timeout $(budget 240) python3 -m benchmarks.startup --model qwen2.5-vl-7b > "$OUT/startup.json" 2> "$OUT/startup.log" ;;
    tests) timeout $(budget 300) python3 -m pytest -q -m gpu tests/unit/encoder/attention/test_attention.py tests/unit/workspace/test_gpu_engine.py tests/unit/encoder/preprocessing/test_preprocess.py tests/unit/encoder/kernels/test_kernels.py tests/unit/encoder/models/test_clip_siglip_gpu.py tests/unit/encoder/models/test_siglip2_gpu.py tests/unit/encoder/models/test_dino_gpu.py tests/unit/workspace/test_text_graphs_gpu.py -p no:cacheprovider 2>&1 | tail -40 > "$OUT/gpu_tests.txt" ;;
    video) timeout $(budget 240) python3 -m pytest -q -rs tests/unit/encoder/preprocessing/test_video_hf_parity.py tests/unit/encoder/models/test_video_hf.py -p no:cacheprovider 2>&1 | tail -40 > "$OUT/video_parity.txt"
           timeout $(budget 200) python3 -m pytest -q -m gpu tests/unit/workspace/test_video_graphs_gpu.py -p no:cacheprovider \
             2>&1 | tail -20 > "$OUT/video_graph_tests.txt" ;;
    videobench) timeout $(budget 200) python3 -m benchmarks.video --json "$OUT/video.json" > "$OUT/video.log" 2>&1
                grep -v "^{" "$OUT/video.log" > "$OUT/video.md" ;;
    attn) timeout $(budget 120) python3 -m benchmarks.attention --check > "$OUT/attention.md" 2>&1 ;;
    bench) timeout $(budget 400) python3 -m benchmarks.engine --json "$OUT/engine.json" --markdown "$OUT/engine_table.md" \
             > "$OUT/engine.md" 2>&1 ;;
    qwen3) timeout $(budget 300) python3 -m pytest -q -m gpu tests/unit/encoder/models/test_qwen3_gpu.py -p no:cacheprovider 2>&1 | tail -30 > "$OUT/qwen3_tests.txt"
           timeout $(budget 300) python3 -m benchmarks.engine --model qwen3-vl-8b --pad-compare --json "$OUT/engine_qwen3.json" \
             > "$OUT/engine_qwen3.md" 2>&1
           timeout $(budget 200) python3 -m benchmarks.engine --backends triton --json "$OUT/engine_q25.json" > "$OUT/engine_q25.md" 2>&1 ;;
    quick) timeout $(budget 120) python3 -m benchmarks.engine --backends triton --no-hf > "$OUT/engine_quick.md" 2>&1 ;;
    launcher) timeout $(budget 240) env RAY_AUTH_MODE=token python3 -m benchmarks.service --model qwen2.5-vl-7b \
                --launcher fast --client-procs 4 --duration 6 --launcher-log "$OUT/launcher_fast.log" \
                > "$OUT/launcher_fast.md" 2> "$OUT/launcher_fast.err" ;;
    launcherdefault) timeout $(budget 200) env RAY_AUTH_MODE=token python3 -m benchmarks.service --model qwen2.5-vl-7b \
                --launcher default --client-procs 4 --duration 6 --skip engine --launcher-log "$OUT/launcher_default.log" \
                > "$OUT/launcher_default.md" 2> "$OUT/launcher_default.err" ;;
    fp8) timeout $(budget 200) python3 -m pytest -q -p no:cacheprovider tests/unit/encoder/models/test_fp8_gpu.py 2>&1 | tail -15 > "$OUT/fp8_tests.txt"
         for m in qwen2.5-vl-7b qwen3-vl-8b; do
           for q in "" "--quantization fp8" "--quantization fp8 --fp8-fast-accum"; do
             timeout $(budget 100) python3 -m benchmarks.engine --model $m --backends auto --no-hf --workloads 32x224,8x896 $q \
               >> "$OUT/fp8_engine.log" 2>&1
           done
         done
         grep "^| ours graph (auto)" "$OUT/fp8_engine.log" > "$OUT/fp8_engine.md" ;;
    fp8profile) for q in "--quantization fp8" ""; do
                  timeout $(budget 60) python3 -m benchmarks.profile_engine --model qwen3-vl-8b --images 32 --rows 25 $q \
                    >> "$OUT/fp8_profile.txt" 2>&1
                done ;;
    fp8quality) timeout $(budget 200) python3 -m benchmarks.fp8_quality ${PHOTOS:+--images "$PHOTOS"} \
                  > "$OUT/fp8_quality.md" 2>&1
                timeout $(budget 100) python3 -m benchmarks.fp8_quality --models qwen2.5-vl-7b --fast-accum \
                  ${PHOTOS:+--images "$PHOTOS"} >> "$OUT/fp8_quality.md" 2>&1
                timeout $(budget 200) python3 -m benchmarks.fp8_quality --models qwen2.5-vl-7b,qwen3-vl-8b \
                  --keep mlp_out,first1+last1,mlp_out+first1+last1 ${PHOTOS:+--images "$PHOTOS"} \
                  >> "$OUT/fp8_quality.md" 2>&1 ;;
    cold) timeout $(budget 420) python3 -m benchmarks.cold_start --export qwen2.5-vl-7b --model /tmp/ckpt-7b --starts 4 \
            --log-dir /tmp/cold --json "$OUT/cold.json" > "$OUT/cold.md" 2> "$OUT/cold.err"
          tar -czf "$OUT/cold_logs.tgz" -C /tmp cold 2> /dev/null ;;
    profile) timeout $(budget 120) python3 -m benchmarks.profile_engine > "$OUT/profile.txt" 2>&1 ;;
    clip) timeout $(budget 150) python3 -m benchmarks.clip > "$OUT/clip.md" 2>&1 ;;
    text) timeout $(budget 150) python3 -m benchmarks.text --json "$OUT/text.json" > "$OUT/text.md" 2>&1 ;;
    towers) timeout $(budget 200) python3 -m benchmarks.towers --json "$OUT/towers.json" > "$OUT/towers.log" 2>&1
            grep -v "^{" "$OUT/towers.log" > "$OUT/towers.md" ;;
    towertests) timeout $(budget 150) python3 -m pytest -q -m gpu tests/unit/encoder/models/test_siglip2_gpu.py \
                  tests/unit/encoder/models/test_dino_gpu.py tests/unit/workspace/test_text_graphs_gpu.py \
                  -p no:cacheprovider --tb=short -W ignore::DeprecationWarning > "$OUT/tower_tests_full.txt" 2>&1
                grep -E "^E |^FAILED|passed|failed|^tests/.*Error|^_+ test" "$OUT/tower_tests_full.txt" | head -60 \
                  > "$OUT/tower_tests.txt" ;;
    batch) timeout $(budget 240) python3 -m benchmarks.batch --as-checkpoint --num-images 20000 --markdown "$OUT/batch.md" \
             > "$OUT/batch.log" 2>&1 ;;
    batch100k) timeout $(budget 400) python3 -m benchmarks.batch --as-checkpoint --num-images 100000 \
                 --markdown "$OUT/batch100k.md" > "$OUT/batch100k.log" 2>&1 ;;
    ckpt) timeout $(budget 120) python3 -c "from pathlib import Path; from benchmarks.batch import export_preset; \
            export_preset('qwen2.5-vl-7b', Path('/tmp/ckpt-7b'))" > "$OUT/ckpt.log" 2>&1 ;;
    svc-*-*)  # svc-R-S[-D]: R replicas per GPU, S merged requests in flight per ingress, D batches per replica
      IFS=- read -r _ r slots depth <<< "$s"
      model=qwen2.5-vl-7b; [ -d /tmp/ckpt-7b ] && model=/tmp/ckpt-7b
      timeout $(budget 200) python3 -m benchmarks.service --model "$model" --replicas-per-gpu "$r" --ingress-slots "$slots" \
        ${depth:+--pipeline-depth "$depth"} ${SVC_EXTRA:-} \
        --ingress-replicas 6 --client-procs 4 --duration 6 --json "$OUT/$s.json" > "$OUT/$s.log" 2>&1
      grep -v "pid=" "$OUT/$s.log" | grep -E "^\||^  \[|^  idle|^model|deployed in" > "$OUT/$s.md" ;;
    service|service1|servicedefault|service1slot|acceptance)
      model=qwen2.5-vl-7b; [ -d /tmp/ckpt-7b ] && model=/tmp/ckpt-7b
      case $s in
        acceptance) extra="--replicas-per-gpu 1 --router-compare" ;;
        service) extra="--replicas-per-gpu 2 --router-compare" ;;
        service1) extra="--replicas-per-gpu 1" ;;
        servicedefault) extra="--replicas-per-gpu 2 --serve-mode default" ;;
        service1slot) extra="--replicas-per-gpu 2 --ingress-slots 1" ;;
      esac
      timeout $(budget 400) python3 -m benchmarks.service --model "$model" $extra --ingress-replicas 6 --client-procs 4 \
        --duration 6 --json "$OUT/$s.json" > "$OUT/$s.log" 2>&1
      grep -v "pid=" "$OUT/$s.log" | grep -E "^\||^  \[|^  ingress|^  idle|^model|deployed in" > "$OUT/$s.md" ;;
  esac
  echo "step $s rc=$? $(( $(date +%s) - start ))s" >> "$OUT/gpu.txt"
done
for f in "$OUT"/util_*.md "$OUT"/utilhf_*.md "$OUT"/engine_table.md; do [ -f "$f" ] && { echo "== $f"; cat "$f"; } >> "$OUT/summary.md"; done
cat "$OUT/gpu.txt"
