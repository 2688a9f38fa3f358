#!/usr/bin/env bash
# The GPU serving run on a lent H200, in stages that each fit one device call:
#   a: sampling on the GPU (tiny GPU = CPU, the race kernel) and the slice checkpoint (s: only that)
#   b: cold starts (first-request TTFT against steady TTFT, kernel-cache misses after the warm-up)
#   c: the slice served through the whole platform against the engine directly
#   d: the engine's decode steps at independent contexts (engine_gpu, a short sweep)
# Results land in benchmarks/results/ and are copied to $OUT. The caller sets ANTUMBRA_COMMIT.
set -uo pipefail
stage=${1:?stage a, b, c or d}
if [ ! -d /tmp/site/ray ]; then
  mkdir -p /tmp/site && tar -xJf .devsite/site.tar.xz -C /tmp/site &&
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .devsite/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
slice=.cache/v4-slice
case $stage in
  a)
    python3 -m benchmarks.sampling_gpu
    [ -f $slice/config.json ] || python3 -m benchmarks.slice_checkpoint $slice
    ;;
  s) [ -f $slice/config.json ] || python3 -m benchmarks.slice_checkpoint $slice ;;
  b) python3 -m benchmarks.cold_start_gpu --model $slice ;;
  c) python3 -m benchmarks.serve_gpu --model $slice ;;
  d) python3 -m benchmarks.engine_gpu --no-tiny --contexts 4096,16384 --batches 1,8,32 --steps 10 ;;
esac
status=$?
cp benchmarks/results/*h200*.json "${OUT:-/tmp}/" 2>/dev/null
exit $status
