#!/usr/bin/env bash
# One device call for the RL and multi-GPU issues on a lent H200:
#   deterministic_gpu   batch-invariant mode's decode throughput against the default plan (slice)
#   engine_multi_gpu    the parallel replica's code path at T=E=1 on one GPU (the 2-GPU run is separate)
# Results land in benchmarks/results/ and are copied to $OUT. The caller sets ANTUMBRA_COMMIT.
set -uo pipefail
if [ ! -d /tmp/site/ray ]; then
  mkdir -p /tmp/site && tar -xJf .devsite/site.tar.xz -C /tmp/site &&
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .devsite/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
status=0
timeout 250 python3 -m benchmarks.deterministic_gpu --ctx 256 --new-tokens 16 --batches 1,8 || status=$?
timeout 300 python3 -m benchmarks.engine_multi_gpu --tp 1 --ep 1 --checkpoint /tmp/slice-release || status=$?
cp benchmarks/results/*h200*.json benchmarks/results/*gpu-engine-multi-gpu*.json "${OUT:-/tmp}/" 2>/dev/null
exit $status
