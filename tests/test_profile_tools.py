"""The GPU profiling tools of ``qa/bench`` on the CPU: ``gemm_profile.py`` starts (its runs need a GPU),
and ``ncu_hotspots.py`` reads Nsight Compute's CSV pages as ncu 2025 writes them (the shapes below are
those of a real report of the FP8 kernel, trimmed): headline metrics per kernel, stall reasons as
shares, the SASS lines with the most stall samples first; ``_trace.py`` reads idle device time and kernel
time by kind from a trace; ``host_sample.py`` summarizes py-spy's samples of a step."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(_ROOT, "qa", "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
         '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')
_ROW = ('"0","1","python3","127.0.0.1","ragged_kernel","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0",'
        '"GPU Speed Of Light Throughput",')
DETAILS = "\n".join(["==PROF== Connected to process", _HEAD, _ROW + '"Duration","ms","1.94"',
                     _ROW + '"Compute (SM) Throughput","%","56.09"',
                     _ROW + '"DRAM Frequency","hz","3,199,460,309.12"']) + "\n"
_STALL = "smsp__pcsamp_warps_issue_stalled_"
_TENSOR = "TPC.TriageCompute.sm__pipe_tensor_cycles_active_realtime.avg.pct_of_peak_sustained_elapsed"
RAW = "\n".join([f'"ID","Kernel Name","{_STALL}barrier","{_STALL}barrier_not_issued","{_STALL}long_scoreboard",'
                 f'"{_STALL}wait","{_TENSOR}","l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_'
                 f'elapsed"', '"","","","","","%","%"',
                 '"0","ragged_kernel","60","55","30","10","30.94","48.86"']) + "\n"
SOURCE = '''"Kernel Name","ragged_kernel",""
"Address","Source","Warp Stall Sampling (All Samples)"
"0x7f00","      LDC R1, c[0x0][0x28]","10"
"0x7f10","      NOP","1,200"
"0x7f20","@!P0  BRA 0x7f80","790"
'''


def test_ncu_hotspots_reads_the_pages():
    h = _load("ncu_hotspots")
    details = h.parse_csv(DETAILS)
    assert len(details) == 3 and details[0]["Kernel Name"] == "ragged_kernel"
    source = h.parse_csv(SOURCE, source_page=True)
    assert [r["Address"] for r in source] == ["0x7f00", "0x7f10", "0x7f20"]
    lines = h.summary(details, h.parse_csv(RAW), source, top=2)
    text = "\n".join(lines)
    assert "== 0 ragged_kernel" in text and "Duration [ms]: 1.94" in text
    assert "DRAM Frequency" not in text  # not a headline metric
    # shares of the sampled stall reasons (the "_not_issued" subsets are not counted twice)
    assert "stall samples (all warps): barrier 60.0%, long_scoreboard 30.0%, wait 10.0%" in text
    # how busy the pipes were: a section-prefixed name read too; the load / store subsets absent here
    assert "% of peak: tensor pipes 30.9%, shared-memory LSU 48.9%" in text and "of it loads" not in text
    top = [line for line in lines if "%  0x" in line]
    assert len(top) == 2 and "NOP" in top[0] and "BRA" in top[1]  # most samples first, "1,200" read as 1200
    assert top[0].strip().startswith("60.0%") and top[1].strip().startswith("39.5%")


def test_ncu_hotspots_reads_stalls_of_one_kernel_only():
    h = _load("ncu_hotspots")
    two = h.parse_csv(DETAILS + DETAILS.splitlines()[-1].replace('"0","1"', '"1","1"', 1))
    lines = h.summary(two, h.parse_csv(RAW), h.parse_csv(SOURCE, source_page=True))
    assert lines[0].startswith("2 kernels in the report") and not any("stall samples" in x for x in lines)


def test_gemm_profile_help():
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, os.path.join(_ROOT, "qa", "bench", "gemm_profile.py"), "--help"],
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--fp8-ab" in proc.stdout and "--ncu" in proc.stdout, proc.stderr[-3000:]
    assert "--wgrad-ab" in proc.stdout and "--wgrad-stages" in proc.stdout


def test_fp8_module_bench_starts():
    """``fp8_module.py`` parses its options (``--host`` among them) and, without a GPU, says so and exits 2."""
    pytest.importorskip("triton")
    bench = os.path.join(_ROOT, "qa", "bench", "fp8_module.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, bench, "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--host" in proc.stdout and "--profile" in proc.stdout, proc.stderr[-3000:]
    proc = subprocess.run([sys.executable, bench, "--host"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "needs a CUDA device" in proc.stderr, (proc.returncode, proc.stderr[-3000:])


def test_fp8_wgrad_trace_summary():
    """``fp8_wgrad_trace.summarize``: shares of the programs' spans from the four clocks per tile, rows
    without chunks (tiles a program did not run) skipped."""
    import torch
    tr = _load("fp8_wgrad_trace")
    trace = torch.tensor([[[0, 10, 20, 100, 9], [110, 120, 130, 210, 9]],
                          [[0, 5, 10, 50, 5], [0, 0, 0, 0, 0]]])
    s = tr.summarize(trace)
    assert s["tiles"] == 3 and s["chunks_per_tile"] == pytest.approx(23 / 3)
    assert s["cycles_per_tile"] == pytest.approx(260 / 3)        # spans 210 + 50
    assert s["cycles_per_later_chunk"] == pytest.approx(200 / 20)  # (80 + 80 + 40) over 8 + 8 + 4 chunks
    assert (s["share_begin"], s["share_handoff"], s["share_chunks"]) == pytest.approx((25 / 260, 25 / 260, 200 / 260))
    assert s["share_between"] == pytest.approx(10 / 260)          # program 0's 10 cycles between its tiles



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


def test_host_sample_summarizes_py_spy_stacks(tmp_path):
    """``host_sample.py --summarize`` ([Note: sampling the host]): self and total shares of py-spy's raw
    samples (``stack count`` lines, frames ``fn (path:line)`` or native ``fn (lib.so)``), one entry per
    function, and host milliseconds a step from the rate and the sampled steps."""
    hs = _load("host_sample")
    stacks = tmp_path / "stacks.txt"
    stacks.write_text("\n".join([
        "<module> (run.py:1);step (/x/train.py:10);quantize (/x/kernels/quantize.py:5) 6",
        "<module> (run.py:1);step (/x/train.py:12);quantize (/x/kernels/quantize.py:9);launch (cuda.so) 2",
        "<module> (run.py:1);step (/x/train.py:10) 2",
        "not a sample line",
    ]) + "\n")
    text = hs.summarize(str(stacks), steps=2, rate=100)
    assert "10 samples" in text and "host ms a step (50.0 in all)" in text  # 10 samples / 100 Hz / 2 steps
    self_part, total_part = text.split("  by total:")
    assert "60.0%    30.00  quantize quantize.py" in self_part  # lines 5 and 9: one function
    assert "20.0%    10.00  launch cuda.so" in self_part and "20.0%    10.00  step train.py" in self_part
    assert "100.0%    50.00  step train.py" in total_part and "80.0%    40.00  quantize quantize.py" in total_part
    assert hs.summarize(str(stacks)).startswith("10 samples; each function's share")  # shares only
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert hs.summarize(str(empty)) == f"{empty}: no samples"
    proc = subprocess.run([sys.executable, os.path.join(_ROOT, "qa", "bench", "host_sample.py"), "--summarize",
                           str(stacks), "--steps", "0"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--steps and --rate must be positive, got 0 and 250" in proc.stderr


def test_host_sample_samples_one_build():
    proc = subprocess.run([sys.executable, os.path.join(_ROOT, "qa", "bench", "host_sample.py"), "--model", "tiny",
                           "--precisions", "bf16,fp8_per_tensor", "--modes", "eager"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": _ROOT})
    assert proc.returncode == 1 and "give one --precisions and one --modes, got bf16,fp8_per_tensor and eager" in (
        proc.stderr), proc.stderr[-2000:]
