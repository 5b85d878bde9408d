"""``benchmarks/trace_summary.py``, which the FSDP2 notes' per-kernel-kind figures come from: on a hand-made trace
with known intervals, the compute-busy, idle, NCCL and exposed-NCCL times and the kinds come out exact."""
from benchmarks.trace_summary import kind_of, summarize


def _k(name, ts, dur, pid=0):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": pid}


def test_busy_idle_and_exposed_nccl_on_known_intervals():
    trace = {"traceEvents": [
        _k("nvjet_sm90_tst_gemm", 0, 1000),              # compute 0-1000
        _k("ncclDevKernel_AllGather_RING_LL", 500, 1000),  # NCCL 500-1500: 500 us not under compute
        _k("triton_poi_fused_mul_0", 2000, 500),          # compute 2000-2500, idle 1500-2000
        _k("_attn_fwd", 2200, 800),                        # overlaps the previous: compute until 3000
        _k("nvjet_other_device", 0, 10_000, pid=1),        # another device: ignored
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 99_999, "pid": 0},  # not a kernel
    ]}
    s = summarize(trace, steps=1)
    assert s["span_ms"] == 3.0
    assert s["compute_busy_ms"] == 2.0   # 0-1000 and 2000-3000
    assert s["nccl_ms"] == 1.0 and s["nccl_exposed_ms"] == 0.5
    assert s["idle_ms"] == 0.5           # 1500-2000
    assert s["by_kind_ms"] == {"matmul": 1.0, "nccl": 1.0, "attention": 0.8, "triton": 0.5}


def test_inductor_kernels_are_triton_whatever_ops_they_name():
    assert kind_of("triton_poi_fused_lora_linear_bwd_mul_silu_silu_backward_view_0") == "triton"
    assert kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
    assert kind_of("_lce_rows_kernel") == "lm-head loss"
    assert kind_of("void at::native::multi_tensor_apply_kernel<AdamW>") == "optimizer"


def test_compute_gaps_are_placed_between_their_kernels_with_the_nccl_inside():
    trace = {"traceEvents": [
        _k("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 0, 400),  # the step's first gather
        _k("nvjet_sm90_tst_gemm", 400, 700),
        _k("triton_poi_fused_mul_0", 1100, 300),                                            # hole 1400-1500: idle
        _k("_attn_fwd", 1500, 500),
        _k("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 1900, 700),                       # 2000-2600 exposed
        _k("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<Adam>(int)", 2600, 300),
    ]}
    gaps = summarize(trace, steps=1)["compute_gaps"]
    # the hole before the first compute kernel is not between two compute kernels: not listed
    assert [(g["at_ms"], g["ms"], g["nccl_ms"]) for g in gaps] == [(2.0, 0.6, 0.6), (1.4, 0.1, 0.0)]
    assert gaps[0]["nccl"] == ["ncclDevKernel_ReduceScatter_Sum_f32_RING_LL"]
    assert gaps[0]["before"] == "_attn_fwd" and gaps[0]["after"] == "at::native::multi_tensor_apply_kernel"
    assert gaps[1]["nccl"] == [] and gaps[1]["before"] == "triton_poi_fused_mul_0"


def test_host_during_idle_credits_the_cpu_ops_over_the_gpu_gaps():
    cpu = lambda name, ts, dur, tid=1: {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                        "pid": 99, "tid": tid}
    trace = {"traceEvents": [
        _k("nvjet_sm90_tst_gemm", 0, 100),
        _k("ncclDevKernel_AllGather_RING_LL", 100, 100),   # NCCL counts as busy: no gap 100-200
        _k("triton_poi_fused_mul_0", 500, 100),            # gap 200-500
        _k("_attn_fwd", 602, 100),                          # gap 600-602: under min_gap_us, left out
        cpu("fxfuse::lora_linear_bwd", 150, 300),           # 200-450 of the gap: 250 us
        cpu("aten::mm", 400, 200),                          # nested: 400-500: 100 us
        cpu("Optimizer.step", 0, 150, tid=2),               # before the gap: nothing
    ]}
    h = summarize(trace, steps=1)["host_during_idle"]
    assert h["gaps"] == 1 and h["gap_ms"] == 0.3
    assert [(o["name"], o["ms"]) for o in h["ops"]] == [("fxfuse::lora_linear_bwd", 0.25), ("aten::mm", 0.1)]
