#!/usr/bin/env bash
# Round-three performance run on one H200 (issue 15), in one device call. Stages (STAGES, comma list):
#   kernels   kernels.py --only moe,mhc (the grouped prefill MoE against the fused kernel)
#   topk      the top-k launch sweep (tune_kernels.py --only topk) and the headline figures (kernels.py)
#   decode    engine_gpu.py decode B1-B64 at 4K (overlap on / off, drained steps, graph replay)
#   prefill   engine_gpu.py: a 16K prefill with its kernel breakdown (--profile-prefill)
#   release   engine_gpu.py with the release-numerics engine at 4K
#   hisparse  engine_gpu.py with the HiSparse engine at 64K
#   full      engine_gpu.py as h200_perf.sh runs it (every figure of the daily file)
#   fresh     fresh_prefill_gpu.py: one prompt prefilled first and again on engines of several start-ups
#   fp8stress fp8_linear_stress_gpu.py: repeated FP8 linear calls on one input, per launch shape
#   gputests  the tests that skip without a GPU (HiSparse's pinned host tier and its graphs, the FP8
#             linear's repeated calls, the fused SwiGLU against torch's CUDA chain)
# Needs .devsite carried (transformers); the caller sets ANTUMBRA_COMMIT. Results: benchmarks/results/ and $OUT.
set -uo pipefail
budget=${BUDGET_S:-540}
start=$(date +%s)
left() { echo $((budget - ($(date +%s) - start))); }
mkdir -p /tmp/site && tar -xJf .devsite/site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
out=${OUT:-/tmp}
today=$(date -u +%Y-%m-%d)
# At most 8 files come back: today's results only.
save() {  # $1: the stage, whose engine file is kept apart (each engine_gpu run rewrites it)
  cp benchmarks/results/"$today"-h200.json "$out/" 2>/dev/null
  [ -n "${1:-}" ] && cp benchmarks/results/"$today"-h200-engine-gpu.json "$out/engine-$1.json" 2>/dev/null
  true
}
has() { [[ ",${STAGES:-topk,decode}," == *",$1,"* ]]; }
python3 -c 'import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)'
if has fp8stress; then
  timeout $(( $(left) * 35 / 100 )) python3 -m benchmarks.fp8_linear_stress_gpu 2>&1 | grep -v Warning | tail -n 100
  cp benchmarks/results/"$today"-h200-fp8-linear-stress.json "$out/" 2>/dev/null
fi
if has fresh; then
  timeout $(( $(left) - 10 )) python3 -m benchmarks.fresh_prefill_gpu ${FRESH_ONLY:+--only $FRESH_ONLY} 2>&1 \
    | grep -v Warning | tail -n 60
  cp benchmarks/results/"$today"-h200-fresh-prefill.json "$out/" 2>/dev/null
fi
if has topk; then
  timeout $(( $(left) * 40 / 100 )) python3 -m benchmarks.tune_kernels --only topk --budget ${TOPK_BUDGET_S:-150} \
    --out "$out/tune-topk.json" 2>&1 | grep -v '^\s*$' | tail -n 80
  timeout 120 python3 -m benchmarks.kernels --only topk --no-engine 2>&1 | tail -n 20
  save
fi
if has gputests; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/cachestore/test_host_tier.py \
    "tests/replicas/test_hisparse.py::test_hisparse_decode_graphs_on_a_gpu_match_the_general_step" \
    "tests/replicas/test_hisparse.py::test_hisparse_page_ins_wait_for_the_closed_window_with_the_indexer_on_a_second_stream" \
    "tests/kernels/test_fp8_linear_kernel.py::test_repeated_calls_on_a_gpu_are_bitwise_equal" \
    tests/kernels/test_swiglu_kernel.py 2>&1 | tail -n 15
fi
if has kernels; then
  timeout 200 python3 -m benchmarks.kernels --only "${KERNELS:-moe,mhc}" --no-engine 2>&1 | tail -n 20
  save
fi
common=(--release-ctx 0 --hisparse-ctx 0 --prefill-extra "" --prefill-chunk-alt 0 --steps 12)
if has decode; then
  rm -f benchmarks/results/"$today"-h200-engine-gpu.json
  timeout $(( $(left) - 10 )) python3 -m benchmarks.engine_gpu --contexts 4096 \
    --batches "${DECODE_BATCHES:-1,8,32,64}" "${common[@]}" 2>&1 | tail -n 60
  save decode
fi
if has prefill; then
  rm -f benchmarks/results/"$today"-h200-engine-gpu.json
  timeout $(( $(left) - 10 )) python3 -m benchmarks.engine_gpu --contexts 16384 --batches 1 --no-tiny \
    --release-ctx 0 --hisparse-ctx 0 --prefill-extra "" --prefill-chunk-alt 0 --steps 4 --profile-prefill \
    2>&1 | tail -n 20
  save prefill
fi
if has release; then
  rm -f benchmarks/results/"$today"-h200-engine-gpu.json
  timeout $(( $(left) - 10 )) python3 -m benchmarks.engine_gpu --contexts 4096 --batches 1 --no-tiny \
    --release-ctx 4096 --hisparse-ctx 0 --prefill-extra "" --prefill-chunk-alt 0 --steps 12 2>&1 | tail -n 40
  save release
fi
if has hisparse; then
  rm -f benchmarks/results/"$today"-h200-engine-gpu.json
  timeout $(( $(left) - 10 )) python3 -m benchmarks.engine_gpu --contexts 65536 --batches 1 --no-tiny \
    --release-ctx 0 --hisparse-ctx 65536 --prefill-extra "" --prefill-chunk-alt 0 --steps 12 2>&1 | tail -n 40
  save hisparse
fi
if has full; then
  rm -f benchmarks/results/"$today"-h200-engine-gpu.json
  timeout $(( $(left) - 10 )) python3 -m benchmarks.engine_gpu --contexts 4096,65536 --batches 1,8,32,64 \
    --long-batches 1,8 --prefill-extra 16384 --steps 12 --profile-prefill 2>&1 | tail -n 60
  save full
fi
