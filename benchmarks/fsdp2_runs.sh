#!/usr/bin/env bash
# FSDP2 rows on one host's GPUs, each impl in its own torchrun with cold compile caches (benchmarks/_cold_runs.sh).
# Run from the repository root on the device machine:
#   FSDP_SHAPE=8b FSDP_SEQ=4096 FSDP_PROFILE=1 bash benchmarks/fsdp2_runs.sh inductor-regional fxfuse-regions ...
# An impl suffixed "+lora" runs with FSDP_LORA=1. Rows: $OUT/fsdp2.jsonl; logs: $OUT/fsdp2.log. BUDGET (s, default
# 540) bounds the whole list: an impl that would start with less than 60 s left is skipped and named in the log.
set -u
BUDGET=${BUDGET:-540}
source "$(dirname "$0")/_cold_runs.sh"
for spec in "$@"; do
    impl=${spec%+lora}; lora=0; [ "$spec" != "$impl" ] && lora=1
    FSDP_LORA=$lora cold_run fsdp2.log 60 "$spec" torchrun --nproc_per_node "$NGPU" benchmarks/bench_fsdp2.py "$impl"
done
grep -h '^{' "$OUT/fsdp2.log" | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l); p = r.get('profile', {})
    print(r['impl'], 'lora' if r['lora'] else 'full', r['tokens_per_s_per_gpu'], r['step_ms'], r['peak_gib'], r['first_step_s'], r.get('start_to_first_step_s'),
          {k: p.get(k) for k in ('compute_busy_ms', 'idle_ms', 'nccl_exposed_ms')}, p.get('by_kind_ms'))"
