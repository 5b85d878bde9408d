# Sourced by fsdp2_runs.sh and hf_trainer_runs.sh: one host's GPUs, each run in its own process with Inductor's
# and Triton's on-disk caches cleared first (its first step is a cold compile; KEEP_CACHES=1 keeps them: the previous
# run's), all runs inside BUDGET seconds.
# Sets OUT, DEADLINE, NGPU and the environment (NVLink multicast off, as the device machines require) and defines
#   cold_run LOG MIN_SECONDS NAME cmd...   append cmd's output to $OUT/LOG under "=== NAME"; skipped (and said so
#                                           in the log) when less than MIN_SECONDS of the budget is left
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEADLINE=$((SECONDS + ${BUDGET:-540}))
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NGPU=${NGPU:-$(python3 -c "import torch; print(torch.cuda.device_count())")}

cold_run() {
    local log=$1 need=$2 name=$3; shift 3
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt "$need" ]; then echo "skipped $name (${left}s left)" >>"$OUT/$log"; return; fi
    # KEEP_CACHES=1: the caches the previous run left (a restarted job's first step), else cold
    [ "${KEEP_CACHES:-0}" = 1 ] || rm -rf "/tmp/torchinductor_$(whoami)" ~/.triton/cache
    echo "=== $name" >>"$OUT/$log"
    timeout "$left" "$@" >>"$OUT/$log" 2>&1 || echo "FAILED $name rc=$?" >>"$OUT/$log"
}
