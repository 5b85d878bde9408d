#!/usr/bin/env bash
# examples/hf_trainer_fsdp2.py on one host's GPUs (random Llama-3.2-1B widths, 2x2048 tokens per GPU), one torchrun
# per mode with cold compile caches (benchmarks/_cold_runs.sh): RESULT lines to $OUT/hf_trainer.jsonl, logs to
# $OUT/hf_trainer.log. Modes: regions (fxfuse.compile_regions), install (fxfuse.install + torch_compile),
# inductor (torch_compile alone), eager. BUDGET (s, default 300) bounds the list; PROFILE=1 profiles the last two steps;
# HF_ARGS adds the example's flags (e.g. "--seq 65536 --rows 1 --gradient-checkpointing", "--pad").
set -u
BUDGET=${BUDGET:-300}
source "$(dirname "$0")/_cold_runs.sh"
for mode in "$@"; do
    case $mode in regions) flag=--regions;; inductor) flag=--inductor;; eager) flag=--no-compile;; *) flag=;; esac
    cold_run hf_trainer.log 40 "$mode" torchrun --nproc_per_node "$NGPU" examples/hf_trainer_fsdp2.py --shape 1b ${PROFILE:+--profile} \
        --steps "${STEPS:-12}" --out /tmp/hf-out $flag ${HF_ARGS:-}
done
grep -h "^RESULT " "$OUT/hf_trainer.log" | sed "s/^RESULT //" >"$OUT/hf_trainer.jsonl"  # the whole log's rows, once each
cat "$OUT/hf_trainer.jsonl"
