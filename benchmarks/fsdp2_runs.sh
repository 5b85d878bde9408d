#!/usr/bin/env bash
# FSDP2 rows on one host's GPUs, each impl in its own torchrun (cold process; Inductor's on-disk caches are
# cleared before each, so first_step_s is a cold compile). Run from the repository root on the device machine:
#   FSDP_SHAPE=8b FSDP_SEQ=4096 FSDP_PROFILE=1 bash benchmarks/fsdp2_runs.sh inductor-regional fxfuse-regions ...
# An impl suffixed "+lora" runs with FSDP_LORA=1. Rows: $OUT/fsdp2.jsonl; logs: $OUT/fsdp2.log. BUDGET (s, default
# 540) bounds the whole list: an impl that would start with less than 60 s left is skipped and named in the log.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-540}; DEADLINE=$((SECONDS + BUDGET))
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NGPU=${NGPU:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
for spec in "$@"; do
    impl=${spec%+lora}; lora=0; [ "$spec" != "$impl" ] && lora=1
    left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 60 ]; then echo "skipped $spec (${left}s left)" >>"$OUT/fsdp2.log"; continue; fi
    rm -rf /tmp/torchinductor_$(whoami) ~/.triton/cache
    echo "=== $spec" >>"$OUT/fsdp2.log"
    FSDP_LORA=$lora timeout "$left" torchrun --nproc_per_node "$NGPU" benchmarks/bench_fsdp2.py "$impl" \
        >>"$OUT/fsdp2.log" 2>&1 || echo "FAILED $spec rc=$?" >>"$OUT/fsdp2.log"
done
grep -h '^{' "$OUT/fsdp2.log" | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l); p = r.get('profile', {})
    print(r['impl'], 'lora' if r['lora'] else 'full', r['tokens_per_s_per_gpu'], r['step_ms'], r['peak_gib'], r['first_step_s'],
          {k: p.get(k) for k in ('compute_busy_ms', 'idle_ms', 'nccl_exposed_ms')}, p.get('by_kind_ms'))"
