# Sourced by the scripts that run on the GPU machine (bench/h200.sh, bench/gpu_check.sh): makes
# $OUT, installs the carried wheels of `.whl/` (what that machine lacks: see bench/h200.sh) into
# /tmp/site, and names the GPU in $OUT/gpu.txt.
OUT=${OUT:-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv | tee "$OUT/gpu.txt"
