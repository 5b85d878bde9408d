#!/usr/bin/env bash
# One device call of the GPU measurements, by part (each part fits one call of at most ~9 minutes on a 2-GPU H200
# host; every job gets what is left of the part's deadline, so a slow job costs the later ones, never the call):
#
#   A  FSDP2 over 2 GPUs, Llama-3-8B widths (16 layers), 2x4096 tokens per GPU, full fine-tune:
#      fxfuse, inductor, fxfuse-regions, inductor-regional, eager               (issue 20)
#   B  the same with PEFT LoRA r16 on all seven projections, then the anchor probe (Llama-3.2-1B shape,
#      2x2048 per GPU) with fxfuse, fxfuse-nolce, inductor, fxfuse-regions      (issues 20, 19)
#   D  the anchor probe's 1B shape without HF's KV cache (use_cache=False): fxfuse, fxfuse-nolce, inductor,
#      inductor-regional (issue 19)
#   C  one GPU each, side by side: GPU 0 fxfuse / GPU 1 Inductor on variable-length data (packed and padded,
#      Llama-3.2-1B shape) then long context (8B widths x 4 layers, LoRA + checkpointing, 16k / 32k tokens);
#      then the anchors' lm-head rows (eager, Inductor, fxfuse, Liger, CCE) on GPU 1   (issues 21, 13, 22)
#
# Run on the device machine from the repository root (wheels in .whl, anchors in .anchors, both carried):
#   bash benchmarks/gpu_session.sh A
# Rows go to $OUT (fsdp2.jsonl, varlen-*.jsonl, anchors.jsonl) and the logs beside them.
set -u
PART=${1:?part A, B or C}
BUDGET=${BUDGET:-540}
DEADLINE=$((SECONDS + BUDGET))
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.:${PYTHONPATH:-}
export COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}
python3 - >"$OUT/env-$PART.json" <<'EOF'
import json, torch, triton, transformers
print(json.dumps(dict(gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                      torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__)))
EOF
cat "$OUT/env-$PART.json"

job() {  # job LOGNAME MIN_SECONDS cmd...: run with what is left of the deadline, skip if less than MIN_SECONDS
    local log=$1 need=$2; shift 2
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt "$need" ]; then echo "skipped (only ${left}s left): $*" | tee -a "$OUT/skipped.txt"; return; fi
    echo "== $(date +%T) [$left s left] $*"
    timeout "$left" "$@" >"$OUT/$log.log" 2>&1
    local rc=$?
    echo "   rc=$rc"; grep -h '^{' "$OUT/$log.log" | tail -3
    [ $rc -eq 0 ] || tail -5 "$OUT/$log.log"
}

case $PART in
A)
    for impl in fxfuse inductor fxfuse-regions inductor-regional eager; do
        FSDP_SHAPE=8b FSDP_LAYERS=16 FSDP_SEQ=4096 FSDP_STEPS=5 \
            job "fsdp2-8b-$impl" 60 torchrun --nproc_per_node 2 benchmarks/bench_fsdp2.py $impl
    done ;;
B)
    for impl in fxfuse inductor fxfuse-regions; do
        FSDP_SHAPE=8b FSDP_LAYERS=16 FSDP_SEQ=4096 FSDP_STEPS=5 FSDP_LORA=1 \
            job "fsdp2-8b-lora-$impl" 60 torchrun --nproc_per_node 2 benchmarks/bench_fsdp2.py $impl
    done
    for impl in fxfuse inductor fxfuse-nolce; do
        job "probe-1b-$impl" 45 torchrun --nproc_per_node 2 .anchors/fsdp2_probe.py $impl
    done
    job "fsdp2-1b-fxfuse-regions" 45 torchrun --nproc_per_node 2 benchmarks/bench_fsdp2.py fxfuse-regions ;;
C)
    # two single-GPU streams at once, one per card
    ( export CUDA_VISIBLE_DEVICES=0
      E2E_IMPLS=fxfuse E2E_STEPS=16 job varlen-e2e-fxfuse 60 python3 benchmarks/bench_varlen.py e2e
      LONG_IMPLS=fxfuse job varlen-long-fxfuse 60 python3 benchmarks/bench_varlen.py long ) &
    ( export CUDA_VISIBLE_DEVICES=1
      E2E_IMPLS=inductor E2E_STEPS=16 job varlen-e2e-inductor 60 python3 benchmarks/bench_varlen.py e2e
      LONG_IMPLS=inductor job varlen-long-inductor 60 python3 benchmarks/bench_varlen.py long
      job anchors-lce 60 python3 .anchors/anchors_gpu.py env lce ) &
    wait ;;
D)  # the 1B shape of the anchor probe, with use_cache=False (the probe leaves HF's cache on: every decoder layer's
    # frame recompiles on `past_key_values.layers[i].is_initialized` until the recompile limit, for every backend)
    for impl in fxfuse fxfuse-nolce inductor inductor-regional; do
        job "fsdp2-1b-$impl" 40 torchrun --nproc_per_node 2 benchmarks/bench_fsdp2.py $impl
    done ;;
esac
echo "part $PART done at ${SECONDS}s"
