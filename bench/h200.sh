#!/usr/bin/env bash
# One device session's worth of GPU checks and benchmarks, each part time-boxed so the whole
# fits one 10-minute command; results and logs go to $OUT (default ./out).
#
#   bash bench/h200.sh        # on the GPU machine, from the repository root
#
# The GPU machine has torch, triton, transformers, grpcio and aiohttp but no grpcio-tools:
# carry `common/generated` (made here by `python -m common.pb`) and, in `.whl/`, wheels of
# what it lacks (grpcio, protobuf, grpcio-health-checking, grpcio-reflection,
# opentelemetry-api/-sdk/-semantic-conventions, gguf, llguidance, and jsonschema with its
# dependencies for the tests; at the versions of the local venv, for Python 3.12:
# `pip download PKG --python-version 3.12 --only-binary=:all: -d .whl`). The copy
# has no .git: pass PAGEDSERVE_COMMIT=$(python3 bench/report.py --commit) to name the tree
# (its commit, with -dirty when the working tree differs from it).
# $OUT/benchmarks_section.md is the dated section for docs/BENCHMARKS.md (bench/report.py).
set -u
source "$(dirname "$0")/device_env.sh"

# The kernel tests (tests/test_kernels.py) compile for minutes on a fresh machine: run them
# in a call of their own, or name them in GPU_TESTS.
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu ${GPU_TESTS:-tests/test_gpu_engine.py} \
    2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
timeout 200 python3 bench/gpu_bench.py --compare-sync --peer-w1-requests 32 --out "$OUT/gpu_bench.json" \
    2>&1 | grep -v "^ *$" | tail -40 | tee "$OUT/gpu_bench.log"
timeout 280 python3 bench/router_bench.py --out "$OUT/router_bench.json" -- \
    --max-model-len 4096 --max-num-seqs 512 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.85 \
    2>&1 | tail -30 | tee "$OUT/router_bench.log"
python3 bench/report.py --gpu "$OUT/gpu_bench.json" --router "$OUT/router_bench.json" \
    --command "bash bench/h200.sh" > "$OUT/benchmarks_section.md"
