#!/usr/bin/env bash
# W5 (realistic online serving, judged by goodput) on one H200 in one device call of under
# ~8 minutes: bench/w5.py starts `pagedserve serve` with the Llama-3.1-8B shape in dummy bf16
# weights (bench/gpu_bench.py's model and engine settings, with a context long enough for the
# 12k-token documents and prefix caching on, its default), warms up, then runs every rate over
# gRPC and over HTTP. $OUT/w5.json (rewritten after every phase, so a run cut short keeps what
# it finished), $OUT/w5.md (the table for docs/BENCHMARKS.md) and $OUT/w5.log.
#
#   bash bench/gpu_w5.sh                              # on the GPU machine, from the repository root
#   W5_RATES=8,16 W5_DURATION=60 bash bench/gpu_w5.sh
#   W5_NAME=t1024 W5_ENGINE_ARGS="--long-prefill-token-threshold 1024" bash bench/gpu_w5.sh
#
# W5_ENGINE_ARGS (default none: the server's own defaults, a 4,096-token step budget on a GPU)
# are the server's scheduling flags;
# W5_NAME suffixes the output files (w5_NAME.json ...), so several settings fit one call.
#
# Carry `common/generated` and `.whl` (see bench/h200.sh); pass PAGEDSERVE_COMMIT to name the commit.
set -u
source "$(dirname "$0")/device_env.sh"
suffix=${W5_NAME:+_$W5_NAME}
# Startup (about a minute: weights, CUDA graphs, kernel compiles) + 8 phases of 30 s of
# arrivals and their drain fit the limit; `timeout` sends SIGTERM, on which w5.py stops the server.
timeout "${W5_TIMEOUT:-540}" python3 bench/w5.py --serve --api "${W5_APIS:-grpc,http}" \
    --rates "${W5_RATES:-4,8,12,16}" --duration "${W5_DURATION:-30}" \
    --model-args "--model llama-3.1-8b --load-format dummy --dtype bfloat16 --max-model-len 16384 \
--max-num-seqs 512 --gpu-memory-utilization 0.85 ${W5_ENGINE_ARGS:-}" \
    --out "$OUT/w5$suffix.json" --markdown "$OUT/w5$suffix.md" 2>&1 | tee "$OUT/w5$suffix.log" \
    | grep -v "^ *$" | tail -60
echo "w5.py exit code ${PIPESTATUS[0]}" | tee -a "$OUT/w5$suffix.log"
