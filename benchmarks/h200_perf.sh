#!/usr/bin/env bash
# Round-two performance run on one H200 (issue 15), in one device call:
#   1. kernels: the top-k headline figures (kernels.py --only topk) and the top-k launch sweep;
#   2. the engine (engine_gpu.py): decode B1-B64 at 4K and B1 / B8 at 64K (overlap scheduling on
#      and off), prefill at 4K / 16K / 64K against the FLOP floor, release numerics at 4K and
#      HiSparse at 64K against the exact fast path; every correctness check beside its figures.
# Results land in benchmarks/results/ and are copied to $OUT as they come. The caller sets
# ANTUMBRA_COMMIT. Optional wheels (transformers 5.23) in $WHEELS are installed first.
set -uo pipefail
budget=${BUDGET_S:-460}
start=$(date +%s)
left() { echo $((budget - ($(date +%s) - start))); }
if [ -n "${WHEELS:-}" ] && [ -d "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
save() { cp benchmarks/results/*h200*.json "${OUT:-/tmp}/" 2>/dev/null; }
python3 -c 'import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)'
timeout $(( $(left) * 20 / 100 )) python3 -m benchmarks.kernels --only topk --no-engine 2>&1 | tail -n 30
save
timeout $(( $(left) * 15 / 100 )) python3 -m benchmarks.tune_kernels --only topk --budget 150 \
  --out "${OUT:-/tmp}/tune-topk.json" 2>&1 | grep -v '^\s*$' | tail -n 40
timeout $(( $(left) - 10 )) python3 -m benchmarks.engine_gpu --contexts 4096,65536 --batches 1,8,32,64 \
  --long-batches 1,8 --prefill-extra 16384 --steps 12
status=$?
save
exit $status
