#!/usr/bin/env bash
# Release numerics on the fixed-shape decode step (issue 15), in one device call on one H200: the
# engine at 4K, B1 decode in exact and in release numerics (`engine_release_vs_exact_step_B1_ctx4096`,
# `engine_release_vs_exact_bytes_per_token`), with the tiny GPU-vs-CPU and transformers checks that
# gate the ratios. The release row's `plan_decode` must read "graphs" (the fixed-shape step ran).
# Results land in benchmarks/results/ and are copied to $OUT. Optional wheels (transformers 5.23) in
# $WHEELS are installed first.
set -uo pipefail
if [ -n "${WHEELS:-}" ] && [ -d "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
timeout "${BUDGET_S:-500}" python3 -m benchmarks.engine_gpu --contexts 4096 --batches 1 --long-batches "" \
  --prefill-extra "" --prefill-chunk-alt 0 --hisparse-ctx 0 --release-ctx 4096 --steps 12
status=$?
cp benchmarks/results/*h200*.json "${OUT:-/tmp}/" 2>/dev/null
exit $status
