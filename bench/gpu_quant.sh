#!/usr/bin/env bash
# Quantization on the GPU in one device call (docs/BENCHMARKS.md): the GPU tests of the FP8 and
# W4A16 kernels, the 8B decoder linears per weight format, and W1/W2 of the engine with FP8
# weights against the bf16 engine in the same run. Carry `common/generated` and `.whl`.
set -u
source "$(dirname "$0")/device_env.sh"
timeout 150 python3 -m pytest -q -m gpu -rfE -p no:cacheprovider tests/test_fp8.py tests/test_w4a16.py 2>&1 \
    | tail -25 | tee "$OUT/quant_tests.log"
timeout 150 python3 bench/quant_linears.py --out "$OUT/quant_linears.json" 2>&1 | tail -8
[ "${QUANT_LINEARS_ONLY:-0}" = 1 ] && exit 0
for q in fp8 none; do
    timeout 200 python3 bench/gpu_bench.py --skip-peer --quantization $q --out "$OUT/engine_$q.json" 2>&1 \
        | grep -E "W1 engine|W2 engine|roofline|Error|error" | tail -6
done
