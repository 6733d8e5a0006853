"""``te_npu.testing.time_shares`` / ``trace_spans``: each span's self time counts once, in the
innermost labelled range around it; device kernels take their launching op's category."""
from __future__ import annotations

import pytest

from te_npu.testing.time_shares import Span, time_shares
from te_npu.testing.trace_spans import spans_from_chrome_trace


def _host(name, start, dur, track=("p", 1)):
    return Span(name, float(start), float(dur), track)


# one 100 us step: forward (GEMM with a nested quantization, an unlabelled BF16 matmul, attention
# decomposed into a matmul), an FSDP all-gather around a quantization, a reduce-scatter, and the rest
STEP = [
    _host("forward", 0, 60),
    _host("te_npu::gemm dense fprop mxfp8_e4m3", 0, 20),
    _host("aten::mm", 2, 10),                              # inside the GEMM range: MM-GMM
    _host("te_npu::quantize mxfp8 row", 12, 5),            # innermost label: quant, not MM-GMM
    _host("aten::abs", 13, 2),
    _host("aten::linear", 20, 10),                         # no label: an aten GEMM op
    _host("aten::addmm", 21, 8),
    _host("aten::scaled_dot_product_attention", 30, 10),   # attention: other, its matmul too
    _host("aten::matmul", 31, 6),
    _host("FSDP::all_gather (model.layers.0)", 40, 15),
    _host("te_npu::quantize hif8 with_scale", 41, 4),      # a quantization inside a gather: quant
    _host("c10d::_allgather_base_", 46, 8),
    _host("FSDP::post_backward_reduce (model.layers.0) [pg=2]", 60, 20),
    _host("c10d::reduce_scatter_tensor_coalesced_", 61, 15),
    _host("Optimizer.step#AdamW.step", 85, 10),
]


def test_each_self_time_counts_once_in_the_innermost_labelled_range():
    shares = time_shares(STEP, wall_us=100.0)
    assert shares["basis"] == "host"
    # MM-GMM: the GEMM range's 20 - its quantization's 5 (its aten::mm included) + the unlabelled linear's 10;
    # other: forward's own 60 - 20 - 10 - 10 - 15 = 5, attention 10 (its matmul included), the optimizer 10
    assert shares["ms"] == {"quant": 0.009, "mm_gmm": 0.025, "all_gather": 0.011, "reduce_scatter": 0.02,
                            "other": 0.025}
    assert shares["percent"]["mm_gmm"] == 25.0 and shares["percent"]["quant"] == 9.0
    # spans cover [0, 80] and [85, 95]: 10 us of the step lie in no op
    assert shares["unattributed_ms"] == 0.01 and shares["unattributed_percent"] == 10.0
    labels = {c: dict(v) for c, v in shares["by_label"].items()}
    assert labels["all_gather"] == {"FSDP::all_gather": 0.011}  # FSDP's "(fqn)" suffix stripped
    assert set(labels["mm_gmm"]) == {"te_npu::gemm dense fprop mxfp8_e4m3", "aten::linear", "aten::addmm"}
    assert "aten::matmul" not in labels["mm_gmm"] and labels["other"]["aten::scaled_dot_product_attention"] == 0.01


def test_spans_nest_per_track_only():
    # a quantization on another thread overlapping the GEMM is no child of it
    spans = [_host("te_npu::gemm dense fprop hif8", 0, 10), _host("te_npu::quantize hif8 current", 2, 4, ("p", 2))]
    shares = time_shares(spans, wall_us=10.0)
    assert shares["ms"]["mm_gmm"] == 0.01 and shares["ms"]["quant"] == 0.004
    assert shares["unattributed_ms"] == -0.004  # two tracks overlap


def test_collective_worker_threads_are_reported_apart_not_counted():
    spans = [_host("FSDP::all_gather", 0, 10), _host("c10d::_allgather_base_", 1, 8),
             _host("gloo:all_gather", 2, 7, ("p", 3)), _host("gloo:all_reduce", 12, 5, ("p", 3))]
    shares = time_shares(spans, wall_us=20.0)
    assert shares["ms"]["all_gather"] == 0.01 and shares["unattributed_ms"] == 0.01
    assert shares["comm_threads_ms"] == {"gloo:all_gather": 0.007, "gloo:all_reduce": 0.005}


def test_device_kernels_take_the_category_of_the_op_that_launched_them():
    spans = [
        _host("te_npu::quantize mxfp8 dual", 0, 10),
        _host("npu::npu_dynamic_mx_quant_with_dual_axis", 1, 8),
        _host("FSDP::all_gather", 10, 10),
        _host("c10d::_allgather_base_", 11, 2),
        Span("DynamicMxQuantWithDualAxis", 5, 30, ("dev", 0), device=True, sources=(1,)),
        Span("hcom_allGather__521_0_1", 40, 20, ("dev", 1), device=True),  # unlinked: by its name
        Span("hcom_reduceScatter__7", 60, 5, ("dev", 1), device=True),
        Span("MemSet", 70, 1, ("dev", 0), device=True),
        Span("ncclKernel_AllGather", 80, 4, ("dev", 1), device=True, sources=(3,)),
    ]
    shares = time_shares(spans, wall_us=100.0)
    assert shares["basis"] == "device"
    assert shares["ms"] == {"quant": 0.03, "mm_gmm": 0.0, "all_gather": 0.024, "reduce_scatter": 0.005, "other": 0.001}
    assert shares["host_ms"]["quant"] == 0.01 and shares["host_ms"]["all_gather"] == 0.01


def test_a_wall_time_of_zero_is_refused():
    with pytest.raises(ValueError, match="wall time"):
        time_shares([], 0.0)


def test_a_torch_npu_style_trace_links_device_tasks_through_flows():
    """String numbers, process names, an Overlap Analysis view and HCCL detail threads, as torch_npu writes."""
    trace = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "Python"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "Ascend Hardware"}},
        {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "Overlap Analysis"}},
        {"ph": "M", "name": "process_name", "pid": 4, "args": {"name": "HCCL"}},
        {"ph": "M", "name": "thread_name", "pid": 4, "tid": 1, "args": {"name": "Communication"}},
        {"ph": "M", "name": "thread_name", "pid": 4, "tid": 2, "args": {"name": "Plane 0"}},
        {"ph": "X", "name": "te_npu::gemm grouped fprop hif8", "pid": 1, "tid": 9, "ts": "100.0", "dur": "50.0"},
        {"ph": "X", "name": "npu::npu_grouped_matmul", "pid": 1, "tid": 9, "ts": "101.5", "dur": "40.0"},
        {"ph": "X", "name": "GroupedMatmul", "pid": 2, "tid": 5, "ts": "300.25", "dur": "80.0", "args": {"Task Type": "AI_CORE"}},
        {"ph": "s", "cat": "async_npu", "name": "torch_to_npu", "id": 7, "pid": 1, "tid": 9, "ts": "102.0"},
        {"ph": "f", "cat": "async_npu", "name": "torch_to_npu", "id": 7, "pid": 2, "tid": 5, "ts": "300.25", "bp": "e"},
        {"ph": "X", "name": "Computing", "pid": 3, "tid": 1, "ts": "300.25", "dur": "80.0"},
        {"ph": "X", "name": "hcom_reduceScatter__1", "pid": 4, "tid": 1, "ts": "400", "dur": "30"},
        {"ph": "X", "name": "Notify_Wait", "pid": 4, "tid": 2, "ts": "401", "dur": "29"},
        {"ph": "s", "cat": "fwdbwd", "id": 1, "pid": 1, "tid": 9, "ts": "101.5"},
        {"ph": "f", "cat": "fwdbwd", "id": 1, "pid": 1, "tid": 9, "ts": "120", "bp": "e"},
    ]}
    from te_npu.testing.step_profile import NPU_TRACE_LAYOUT

    spans = spans_from_chrome_trace(trace, **NPU_TRACE_LAYOUT)
    assert sorted(s.name for s in spans if s.device) == ["GroupedMatmul", "hcom_reduceScatter__1"]
    kernel = next(s for s in spans if s.name == "GroupedMatmul")
    assert [spans[i].name for i in kernel.sources] == ["npu::npu_grouped_matmul"]
    shares = time_shares(spans, wall_us=1000.0)
    assert shares["ms"] == {"quant": 0.0, "mm_gmm": 0.08, "all_gather": 0.0, "reduce_scatter": 0.03, "other": 0.0}


def test_a_kineto_cuda_style_trace_links_kernels_through_ac2g_flows():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "te_npu::quantize mxfp8 row", "pid": 10, "tid": 10, "ts": 0, "dur": 20},
        {"ph": "X", "cat": "cpu_op", "name": "aten::abs", "pid": 10, "tid": 10, "ts": 1, "dur": 5},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 10, "tid": 10, "ts": 2, "dur": 2},
        {"ph": "X", "cat": "kernel", "name": "vectorized_elementwise_kernel", "pid": 0, "tid": 7, "ts": 30, "dur": 9},
        {"ph": "s", "cat": "ac2g", "id": 42, "pid": 10, "tid": 10, "ts": 2},
        {"ph": "f", "cat": "ac2g", "id": 42, "pid": 0, "tid": 7, "ts": 30, "bp": "e"},
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "PyTorch Profiler", "ts": 0, "dur": 100},
    ]}
    spans = spans_from_chrome_trace(trace)
    assert len(spans) == 4  # the profile's own span is skipped
    kernel = next(s for s in spans if s.device)
    assert spans[kernel.sources[0]].name == "cudaLaunchKernel"  # innermost host span at the flow start
    assert time_shares(spans, 100.0)["ms"]["quant"] == 0.009


def test_mean_over_ranks_averages_percent_and_gives_ms_per_step():
    from te_npu.testing.time_shares import mean_over_ranks

    a = time_shares(STEP, wall_us=100.0)
    b = time_shares([*STEP, _host("gloo:all_reduce", 0, 20, ("p", 9))], wall_us=200.0)
    mean = mean_over_ranks([a, b], steps=2)
    assert mean["percent"]["quant"] == pytest.approx((9.0 + 4.5) / 2)
    assert mean["ms_per_step"]["mm_gmm"] == pytest.approx(0.025 / 2)
    assert mean["wall_ms_per_step"] == pytest.approx((0.1 + 0.2) / 2 / 2)
    assert mean["comm_threads_percent"] == {"gloo:all_reduce": pytest.approx(10.0 / 2)}
    with pytest.raises(ValueError, match="at least one rank"):
        mean_over_ranks([], steps=2)
