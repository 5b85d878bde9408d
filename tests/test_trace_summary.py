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


def test_beside_nccl_compares_one_kernel_at_one_grid_with_and_without_nccl():
    g = lambda name, ts, dur, grid: {**_k(name, ts, dur), "args": {"grid": grid}}  # noqa: E731
    trace = {"traceEvents": [
        _k("ncclDevKernel_AllGather_RING_LL", 0, 1000),
        g("nvjet_sm90_tst_gemm", 0, 600, [132, 1, 1]),      # beside NCCL all its time: 600 us
        g("nvjet_sm90_tst_gemm", 900, 500, [132, 1, 1]),    # 100 of 500 beside NCCL: neither group
        g("nvjet_sm90_tst_gemm", 2000, 400, [132, 1, 1]),   # alone: 400 us
        g("nvjet_sm90_tst_gemm", 3000, 400, [132, 1, 1]),   # alone: 400 us
        g("nvjet_sm90_tst_gemm", 4000, 100, [8, 1, 1]),     # another grid, never beside NCCL: not compared
        g("triton_poi_fused_mul_0", 100, 200, [64, 1, 1]),  # beside only: not compared
    ]}
    b = summarize(trace, steps=1)["beside_nccl"]
    assert b["overlapped_ms_by_kind"] == {"matmul": 0.7, "triton": 0.2}
    [row] = b["groups"]
    assert (row["beside"], row["alone"], row["mean_beside_us"], row["mean_alone_us"], row["ratio"]) == (
        1, 2, 600.0, 400.0, 1.5)
    # the compared matmul launches took 1.4 ms; at their no-NCCL speed, 3 x 400 us
    assert b["matmul_compared_ms"] == 1.4 and b["matmul_alone_ms"] == 1.2


def test_beside_nccl_keeps_a_persistent_kernels_shapes_apart_by_their_launching_op():
    # a persistent kernel: grid 132 at any shape. Its long launches (K = 14336) ran beside NCCL, its short ones
    # (K = 4096) alone: by name and grid alone they would read as a 3x slowdown
    def launch(ts, dur, ext):
        return {**_k("_lowrank_gemm_kernel", ts, dur), "args": {"grid": [132, 1, 1], "External id": ext}}

    def op(ext, dims):
        return {"ph": "X", "cat": "cpu_op", "name": "fxfuse::lora_linear_fwd", "ts": 0, "dur": 1, "pid": 99,
                "args": {"External id": ext, "Input Dims": dims}}
    trace = {"traceEvents": [
        _k("ncclDevKernel_AllGather_RING_LL", 0, 1000),
        op(1, [[8192, 14336]]), launch(0, 900, 1),
        op(2, [[8192, 4096]]), launch(2000, 300, 2),
        op(3, [[8192, 14336]]), launch(3000, 800, 3),
        op(4, [[8192, 4096]]), launch(4000, 300, 4),
    ]}
    [row] = summarize(trace, steps=1)["beside_nccl"]["groups"]
    assert (row["op"], row["beside"], row["alone"], row["ratio"]) == ("fxfuse::lora_linear_fwd", 1, 1, 1.125)
