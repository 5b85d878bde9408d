#!/usr/bin/env bash
# examples/hf_trainer_fsdp2.py on one host's GPUs (random Llama-3.2-1B widths, 2x2048 tokens per GPU), one torchrun
# per mode, Inductor's caches cleared before each: RESULT lines to $OUT/hf_trainer.jsonl, logs to
# $OUT/hf_trainer.log. Modes: regions (fxfuse.compile_regions), install (fxfuse.install + torch_compile),
# inductor (torch_compile alone), eager. BUDGET (s, default 300) bounds the list.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-300}; DEADLINE=$((SECONDS + BUDGET))
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NGPU=${NGPU:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
for mode in "$@"; do
    case $mode in regions) flag=--regions;; inductor) flag=--inductor;; eager) flag=--no-compile;; *) flag=;; esac
    left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 40 ]; then echo "skipped $mode (${left}s left)" >>"$OUT/hf_trainer.log"; continue; fi
    rm -rf /tmp/torchinductor_$(whoami) ~/.triton/cache
    echo "=== $mode" >>"$OUT/hf_trainer.log"
    timeout "$left" torchrun --nproc_per_node "$NGPU" examples/hf_trainer_fsdp2.py --shape 1b --steps ${STEPS:-12} \
        --out /tmp/hf-out $flag >>"$OUT/hf_trainer.log" 2>&1 || echo "FAILED $mode rc=$?" >>"$OUT/hf_trainer.log"
done
grep -h '^RESULT ' "$OUT/hf_trainer.log" | sed 's/^RESULT //' | tee -a "$OUT/hf_trainer.jsonl"
