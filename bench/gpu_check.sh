#!/usr/bin/env bash
# The GPU checks every change to the worker, kernels or model code runs before it is called done
# (docs/GPU-TESTS.md), in device calls of under 10 minutes each:
#
#   bash bench/gpu_check.sh stress      # pytest -m gpu: the stress, serving and engine suites
#   bash bench/gpu_check.sh kernels     # pytest -m gpu: kernels, quantization, FP8 KV cache, LoRA
#   bash bench/gpu_check.sh memcheck    # compute-sanitizer memcheck over a serving scenario, then W1/W2
#
# Carry `common/generated` and `.whl` (see bench/h200.sh for the wheels). Results go to $OUT.
set -u
source "$(dirname "$0")/device_env.sh"
mode="${1:-stress}"
case "$mode" in
stress|kernels)
    group=$([ "$mode" = kernels ] && echo kernels || echo engine)
    timeout 560 python3 bench/gpu_stress.py ${GPU_FILES:-} --group "$group" --out "$OUT/gpu_$mode.json" 2>&1 \
        | tee "$OUT/gpu_$mode.log" | grep -E "passed|failed|error|FAIL|Error" | tail -80
    ;;
memcheck)
    timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
        python3 bench/memcheck_scenario.py > "$OUT/memcheck.log" 2>&1
    echo "memcheck exit code $?" | tee -a "$OUT/memcheck.log"
    tail -8 "$OUT/memcheck.log"
    timeout 240 python3 bench/gpu_bench.py --peer-w1-requests 32 --out "$OUT/gpu_bench.json" 2>&1 \
        | grep -v "^ *$" | tail -30 | tee "$OUT/gpu_bench.log"
    ;;
esac
