#!/usr/bin/env bash
# Everything a single-GPU device session should run, in one call, writing its results under OUT_DIR
# (default: $OUT on the device machine, else runs/gpu_session). Each step is independent: a failure is
# recorded in the summary table and the next step still runs. Usage, from the repository root:
#
#   bash qa/L2_gpu/session.sh            # all steps
#   STEPS="tests bench_gemm" bash qa/L2_gpu/session.sh
#   GPU_TESTS="tests/test_gpu_modules.py ..." limits the tests step to those paths.
#   Extra steps (tuning): sweep_wgrad (accumulating wgrad tile candidates), sweep_ragged (fprop/dgrad
#   tile candidates), gemm_fp8 (FP8 grouped GEMM only), gemm_fp8_sweep (every FP8 tile candidate),
#   quant_sweep (quantize tuning candidates), quant_graph (quantize timed by CUDA-graph replays),
#   quant_gluon (qa/L2_gpu/rowcol_gluon_check.py: the Gluon rows + columns quantize, repeated and timed),
#   tma_alignment (qa/L2_gpu/tma_token_alignment.py: which token offsets a TMA load of fp8 accepts),
#   train_fp8 (the FP8 job alone), train_fp8_te (per-tensor FP8 with and without TE's fprop accumulation), fp8_audit (qa/L2_gpu/fp8_kernel_audit.py and its bisect variants),
#   multi_gpu (two GPUs: the job and megatron-core's schedule under torchrun over NCCL, and the multi-rank
#   tests that run over NCCL: pytest -m gpu -k nccl),
#   gluon_wgrad16 (the bf16 Gluon wgrad: its GPU tests, then its variants beside the Triton kernel),
#   half_tail (bf16 fprop/dgrad: the GPU tests of the ragged kernels, then the default config beside itself
#   with half_tail flipped, three interleaved rounds),
#   gemm_fp8_gluon (FP8 fprop/dgrad: the Gluon kernel beside the Triton kernel),
#   gemm_fp8_wgrad (per-tensor FP8 wgrad: the Gluon kernel's launch choices beside the Triton kernel),
#   GEMM_SWEEP_ARGS (e.g. "--gemm-recipes per_tensor --gemm-ops fprop") narrows gemm_fp8_sweep.
#   cpu_full (the CPU suite with --full: every case of the sweeps that CI samples; many cores help).
# The tests step runs with --full (tests/conftest.py). The benchmarks append their rows to
# $OUT_DIR/results.jsonl (DISTWGRAD_RESULTS); append that file to docs/benchmarks/results.jsonl and run
# `PYTHONPATH=. python qa/bench/report.py` to publish them.
#
# megatron-core for the real-schedule step travels as a wheel in .whl/ (ignored by git), fetched on a
# machine with the package index:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT_DIR=${OUT_DIR:-${OUT:-runs/gpu_session}}
mkdir -p "$OUT_DIR"
case $OUT_DIR in /*) OUT_ABS=$OUT_DIR ;; *) OUT_ABS=$PWD/$OUT_DIR ;; esac
export DISTWGRAD_RESULTS=${DISTWGRAD_RESULTS:-$OUT_ABS/results.jsonl}  # the benchmarks' rows (qa/bench/results.py)
STEPS=${STEPS:-"tests bench_gemm bench_fp8 megatron train bench_gemm_graph cpu_full"}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}  # seconds per step: a hang costs one step, not the session
if ! python3 -c "import distwgrad.kernels" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
declare -A RESULT
LOG="$OUT_DIR/session.log"  # one log, so the results are a handful of files
: >"$LOG"
run() {  # run NAME CMD...: appends to session.log, records the exit code
  local name=$1; shift
  echo "== $name: $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$STEP_TIMEOUT" "$@" >>"$LOG" 2>&1
  RESULT[$name]="rc=$? $((SECONDS - t0))s"
  tail -n 3 "$LOG"
}
for step in $STEPS; do
  case $step in
    tests) run gpu_tests python3 -m pytest ${GPU_TESTS:-tests} -m gpu --full -q -p no:cacheprovider -s -rf \
             --tb=short --timeout 150 --durations 12 ;;
    cpu_full) run cpu_full env CUDA_VISIBLE_DEVICES= python3 -m pytest tests -m "not distributed and not gpu" --full -q -p no:cacheprovider \
                -n "${PYTEST_WORKERS:-auto}" -rf --tb=short ;;
    sweep_wgrad) run sweep_wgrad python3 qa/bench/kernels.py gemm --ops wgrad_accumulate --sweep \
                   --sweep-ops wgrad_accumulate --sweep-rep 30 --sweep-json "$OUT_DIR/sweep_wgrad.json" ;;
    sweep_ragged) run sweep_ragged python3 qa/bench/kernels.py gemm --ops fprop dgrad --sweep \
                    --sweep-ops fprop dgrad --sweep-json "$OUT_DIR/sweep_ragged.json" ;;
    gluon_wgrad16) run gluon_wgrad16_tests python3 -m pytest tests/test_grouped_gemm_gpu.py \
                     tests/test_grouped_gemm_fp8_gpu.py -m gpu -k gluon_wgrad -q -p no:cacheprovider -rf \
                     --tb=short --timeout 150
                   run gluon_wgrad16 python3 qa/bench/kernels.py gemm --ops wgrad_accumulate --gluon-wgrad \
                     --triton-rows --no-check --rep 50 --json "$OUT_DIR/gluon_wgrad16.json" ;;
    half_tail) run half_tail_tests python3 -m pytest tests/test_grouped_gemm_gpu.py -m gpu -k "half_tail or test_gpu_bf16 \
                 or wide_tail or e256 or cuda_graph or other_dtypes" -q -p no:cacheprovider -rf --tb=short --timeout 150
               run half_tail python3 qa/bench/kernels.py gemm --ops fprop dgrad --half-tail-rows --rounds 3 \
                 --json "$OUT_DIR/half_tail.json" ;;
    gemm_fp8_gluon) run gemm_fp8_gluon python3 qa/bench/kernels.py fp8 --benchmarks grouped_gemm --gemm-ops fprop dgrad \
                      --gemm-recipes per_tensor blockwise --gluon-stages 4 --gluon-variants m128 \
                      --json "$OUT_DIR/gemm_fp8_gluon.json" ;;
    gemm_fp8_wgrad) run gemm_fp8_wgrad python3 qa/bench/kernels.py fp8 --benchmarks grouped_gemm --gemm-ops wgrad \
                      wgrad_accumulate --gemm-recipes per_tensor --gluon-wgrad --json "$OUT_DIR/gemm_fp8_wgrad.json" ;;
    gemm_fp8) run gemm_fp8 python3 qa/bench/kernels.py fp8 --benchmarks grouped_gemm --json "$OUT_DIR/gemm_fp8.json" ;;
    gemm_fp8_sweep) run gemm_fp8_sweep python3 qa/bench/kernels.py fp8 --benchmarks grouped_gemm --gemm-sweep \
                      ${GEMM_SWEEP_ARGS:-} --json "$OUT_DIR/gemm_fp8_sweep.json" ;;
    quant_graph) run quant_graph python3 qa/bench/kernels.py fp8 --benchmarks quantize --cuda-graph \
                   --json "$OUT_DIR/quantize_cuda_graph.json" ;;
    quant_gluon) run quant_gluon python3 qa/L2_gpu/rowcol_gluon_check.py ;;
    tma_alignment) run tma_alignment python3 qa/L2_gpu/tma_token_alignment.py ;;
    quant_sweep) run quant_sweep python3 qa/bench/kernels.py fp8 --benchmarks quantize --quant-sweep \
                   --json "$OUT_DIR/quant_sweep.json" ;;
    bench_gemm) run bench_gemm python3 qa/bench/kernels.py gemm --rounds 3 --json "$OUT_DIR/grouped_gemm_h200.json" \
                  --plot "$OUT_DIR/grouped_gemm_h200.png" ;;
    bench_gemm_graph) run bench_gemm_graph python3 qa/bench/kernels.py gemm --cuda-graph --no-check \
                        --json "$OUT_DIR/grouped_gemm_h200_graph.json" ;;
    bench_fp8) run bench_fp8 python3 qa/bench/kernels.py fp8 --json "$OUT_DIR/fp8_h200.json" ;;
    megatron) run megatron python3 qa/L2_gpu/megatron_real_schedule.py ;;
    fp8_audit)  # every FP8 GEMM/quantization of the job vs emulation, then one bisect run per variant
      for v in "" "--first-picks" "--emulate-gemm wgrad" "--emulate-gemm dgrad" "--emulate-gemm fprop"; do
        run "fp8_audit${v:+ $v}" python3 qa/L2_gpu/fp8_kernel_audit.py --recipe fp8_blockwise --steps 8 $v \
          --out /tmp/fp8_audit
        python3 -c "import json; print('loss', [round(x, 4) for x in json.load(open(
          '/tmp/fp8_audit/report.json'))['loss']])" | tee -a "$LOG"
      done ;;
    train_fp8) run train_fp8 python3 -m distwgrad.launch.train --steps 20 --recipe fp8_blockwise --check-parity \
                 --no-progress --out /tmp/train_fp8
               cp /tmp/train_fp8/report.json "$OUT_DIR/train_fp8_report.json" 2>/dev/null ;;
    train_fp8_te)  # per-tensor FP8, split accumulator against TransformerEngine's fprop choice
      for r in fp8_per_tensor fp8_per_tensor_te; do
        run "train_$r" python3 -m distwgrad.launch.train --steps 20 --recipe $r --check-parity --no-progress \
          --out "/tmp/train_$r"
        cp "/tmp/train_$r/report.json" "$OUT_DIR/train_${r}_report.json" 2>/dev/null
      done ;;
    train) run train_bf16 python3 -m distwgrad.launch.train --steps 50 --check-parity --no-progress --out /tmp/train_bf16
           cp /tmp/train_bf16/report.json "$OUT_DIR/train_bf16_report.json" 2>/dev/null
           run train_fp8 python3 -m distwgrad.launch.train --steps 20 --recipe fp8_blockwise --check-parity \
             --no-progress --out /tmp/train_fp8
           cp /tmp/train_fp8/report.json "$OUT_DIR/train_fp8_report.json" 2>/dev/null ;;
    multi_gpu)  # two GPUs (nvidia-h200-x2): the job and megatron-core's real schedule over NCCL, sharded
      run nccl_tests python3 -m pytest tests -m gpu -k nccl -q -p no:cacheprovider -rf --tb=short --timeout 280
      run train_2gpu torchrun --standalone --nproc-per-node 2 -m distwgrad.launch.train --steps 30 --check-parity \
        --no-progress --out /tmp/train_2gpu
      cp /tmp/train_2gpu/report.json "$OUT_DIR/train_2gpu_report.json" 2>/dev/null
      run megatron_2gpu torchrun --standalone --nproc-per-node 2 qa/L2_gpu/megatron_real_schedule.py ;;
    *) echo "unknown step: $step" >&2; RESULT[$step]="unknown" ;;
  esac
done
echo
printf '%-14s %s\n' step result
for k in "${!RESULT[@]}"; do printf '%-14s %s\n' "$k" "${RESULT[$k]}"; done
