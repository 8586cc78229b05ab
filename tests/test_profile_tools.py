"""The profiling helper of ``qa/bench`` on the CPU: ``_trace.py`` reads idle device time and kernel time by
kind from a trace (``train_step.py --profile``)."""

from __future__ import annotations

import importlib.util
import os

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(_ROOT, "qa", "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod



def test_idle_gaps_charge_each_gap_to_the_host_work_beside_it():
    """``_trace.idle_gaps`` ([Note: idle device time]): three kernels with two gaps (4 and 30 us; the first
    below the 5 us floor); the second (100-130 us) is charged to the host's outermost ops overlapping it
    (20 us in ``module_forward``, 4 in ``aten::mm``, 6 in none) and, whole, to the innermost op enclosing
    the late kernel's launch."""
    tr = _load("_trace")
    host = [
        {"ph": "X", "cat": "cpu_op", "name": "distwgrad::module_forward", "ts": 90, "dur": 30, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 125, "dur": 4, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 126, "dur": 1, "tid": 1,
         "args": {"correlation": 3}},
    ]
    device = [
        {"ph": "X", "cat": "kernel", "name": "a", "ts": 0, "dur": 50, "tid": 7, "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "b", "ts": 54, "dur": 46, "tid": 7, "args": {"correlation": 2}},
        {"ph": "X", "cat": "gpu_memset", "name": "m", "ts": 60, "dur": 10, "tid": 8},  # under b: no gap
        {"ph": "X", "cat": "kernel", "name": "c", "ts": 130, "dur": 20, "tid": 7, "args": {"correlation": 3}},
    ]
    g = tr.idle_gaps({"traceEvents": host + device + [{"ph": "M", "name": "meta"}]})
    assert (g["window_us"], g["busy_us"], g["idle_us"], g["gaps"]) == (150, 116, 30, 1)
    assert g["by_host_op"] == {"distwgrad::module_forward": 20, "aten::mm": 4, "(python between ops)": 6}, g
    assert g["by_launch_op"] == {"aten::mm": 30}
    text = tr.idle_table(g)
    assert "idle 0.03 ms in 1 gaps" in text and "distwgrad::module_forward" in text
    assert tr.idle_gaps({"traceEvents": host})["gaps"] == 0
    # a Triton kernel's launch is a driver call (cuLaunchKernelEx), correlated the same way
    driver = [dict(e, cat="cuda_driver", name="cuLaunchKernelEx") if e.get("cat") == "cuda_runtime" else e
              for e in host]
    assert tr.idle_gaps({"traceEvents": driver + device})["by_launch_op"] == {"aten::mm": 30}


def test_kernel_time_by_kind():
    """``_trace.kernel_kinds`` ([Note: kernel time by kind]): kernel names of a graphed per-tensor FP8 step's
    trace, each in its kind, summed a step; memsets and unknown kernels are "other"; the table's line."""
    tr = _load("_trace")
    names = {
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "gemm", "ragged_kernel": "gemm",
        "_ragged_m_kernel": "gemm", "wgrad_kernel": "gemm", "_fp8_ragged_kernel": "gemm",
        "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<...>>": "gemm",
        "_amax_kernel": "quantize", "_cast_per_tensor_kernel": "quantize", "_cast_group_kernel": "quantize",
        "_transpose_aligned_kernel": "quantize", "_cast_transpose_kernel": "quantize", "rowcol_kernel": "quantize",
        "_quantize_blocks_kernel": "quantize",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>": "optimizer",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64": "attention",
        "void cudnn::fusion::compute_dot_do_o_specialized<...>": "attention",
        "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda>": "other",
        "triton_poi_fused_gelu_gelu_backward_2": "other", "Memset (Device)": "other",
    }
    assert {n: tr.kernel_kind(n) for n in names} == names
    trace = {"traceEvents": [{"ph": "X", "cat": "kernel", "name": "ragged_kernel", "ts": 0, "dur": 3000},
                             {"ph": "X", "cat": "kernel", "name": "_amax_kernel", "ts": 0, "dur": 1000},
                             {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 0, "dur": 500},
                             {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9000},
                             {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_gelu_9", "ts": 0, "dur": 500}]}
    ms = tr.kinds_of_trace(trace, steps=2)
    assert ms == {"gemm": 1.5, "quantize": 0.5, "optimizer": 0.0, "attention": 0.0, "other": 0.5, "total": 2.5}
    line = tr.kinds_table(ms)
    assert "kernel time a step 2.50 ms: gemm 1.50 (60%), quantize 0.50 (20%)" in line
    assert line.endswith("without the quantization passes 2.00 ms")
    with pytest.raises(ValueError, match="steps must be positive, got 0"):
        tr.kernel_kinds([], steps=0)


