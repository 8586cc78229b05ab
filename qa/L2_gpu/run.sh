#!/usr/bin/env bash
# The GPU runner: named steps for one device call, each with a time limit, its exit code in the summary,
# logs and rows under OUT_DIR (default $OUT, else runs/gpu). From the repository root:
#
#   bash qa/L2_gpu/run.sh                          # the default steps: tests job bench layer
#   STEPS="job bench_fp8" bash qa/L2_gpu/run.sh    # some steps
#   DRY_RUN=1 STEPS=all bash qa/L2_gpu/run.sh      # print each step's commands, run nothing
#
# Steps:
#   tests         the GPU tests with --full in GPU_WORKERS processes (default 6, 0: one); GPU_TESTS: paths,
#                 PYTEST_ARGS: e.g. "-k nccl", TEST_SHARD=i/n: every n-th file with GPU tests from the i-th, for a
#                 suite longer than one call; cpu_full: the CPU suite with --full, the GPU hidden
#   te_swap       TransformerEngine's public test files through the import swap (TE_TESTS: a folder of TE's
#                 tests/pytorch files, carried with the tree; qa/te_swap/run.sh)
#   job           the job at the large preset: bf16 --check-parity, FP8 per-tensor, CUDA-graphed --check-parity;
#                 and the tiny preset compiled + graphed --check-parity, bf16 and per-tensor FP8
#   job_recipes   the tiny job with fused AdamW, --check-parity, each recipe eager and compiled + graphed
#   bench         the whole step at large beside FSDP2 and plain torch, bf16, eager / compiled / graphed
#   bench_fp8     the whole step at large, one precision a process (FP8_MODES, default eager)
#   bench_recipes the whole step at large, bf16 and both recipes in one process a mode and microbatch count
#                 (RECIPE_MODES, default eager compiled compiled_cuda_graph; RECIPE_MB, default 1 2): docs/fp8.md's
#                 table of the recipes at large
#   bench_best    the bf16 best configurations, distwgrad beside each peer in one group of rotated rounds
#   bench_peers_fp8  the whole step at large, bf16 and per-tensor FP8, distwgrad beside the plain and FSDP2 builds
#                 converted to torchao's FP8 (its wheel in .whl/: pip download --no-deps torchao -d .whl), one
#                 process a mode (PEER_MODES, default eager compiled)
#   bench_xl      the xl preset, one build alive at a time (80 GB of fp32 state: one H200), each precision's
#                 builds in one process: distwgrad bf16 and both recipes, then the plain build bf16 and torchao
#                 (XL_MODES, default eager compiled_cuda_graph; XL_MB microbatches, default 1; XL_IMPLS, default
#                 "distwgrad torch")
#   layer         the layer step (MoE layer and tied embedding, bf16 and both recipes, beside the plain layer and
#                 torchao's FP8), eager and graphed
#   kernels       qa/bench/kernels.py gemm and fp8 (KERNEL_ARGS); sweeps: sweep_gemm, sweep_fp8, sweep_quant
#   curves        the FP8 loss bound's four runs a seed (CURVE_SEEDS, CURVE_STEPS, CURVE_RUNS, CURVE_ARGS),
#                 then qa/bench/loss_curves.py over their reports ($OUT_DIR/curves/)
#   megatron      megatron-core's real schedule (its wheel in .whl/, fetched on a machine with the index:
#                 pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl megatron-core==0.16.1)
#   tools         qa/L2_gpu's checks: the FP8 audit, the Gluon quantize check, TMA token alignment
#   multi_gpu     two GPUs: the NCCL tests, the job and megatron-core's schedule under torchrun
#
# Rows land in $OUT_DIR/results.jsonl (DISTWGRAD_RESULTS); append them to docs/benchmarks/results.jsonl and
# run `PYTHONPATH=. python qa/bench/report.py`. On a tree without .git, set DISTWGRAD_COMMIT=<short sha>.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ALL="tests cpu_full te_swap job job_recipes bench bench_fp8 bench_recipes bench_best bench_peers_fp8 bench_xl layer kernels sweep_gemm
     sweep_fp8 sweep_quant curves megatron tools multi_gpu"
STEPS=${STEPS:-"tests job bench layer"}
[ "$STEPS" = all ] && STEPS=$ALL
OUT_DIR=${OUT_DIR:-${OUT:-runs/gpu}}
case $OUT_DIR in /*) OUT_ABS=$OUT_DIR ;; *) OUT_ABS=$PWD/$OUT_DIR ;; esac
DRY_RUN=${DRY_RUN:-}
if [ -z "$DRY_RUN" ]; then
  mkdir -p "$OUT_ABS"
  export DISTWGRAD_RESULTS=${DISTWGRAD_RESULTS:-$OUT_ABS/results.jsonl}
  python3 -c "import distwgrad.kernels" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . \
    >"$OUT_ABS/install.log" 2>&1
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
      export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
LOG="$OUT_ABS/run.log"
[ -n "$DRY_RUN" ] || : >"$LOG"
declare -A RESULT
ORDER=()
run() {  # run NAME CMD...: the command's output into run.log, its exit code and seconds into the summary
  local name=$1; shift
  if [ -n "$DRY_RUN" ]; then echo "$name: $*"; return; fi
  ORDER+=("$name")
  echo "== $name: $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "${STEP_TIMEOUT:-300}" "$@" >>"$LOG" 2>&1
  RESULT[$name]="rc=$? $((SECONDS - t0))s"
  echo "   ${RESULT[$name]}" | tee -a "$LOG"
}
if [ -n "${TEST_SHARD:-}" ]; then
  shard_i=${TEST_SHARD%/*} shard_n=${TEST_SHARD#*/}
  if ! [[ "$shard_i" =~ ^[0-9]+$ && "$shard_n" =~ ^[0-9]+$ ]] || [ "$shard_n" -eq 0 ] || [ "$shard_i" -ge "$shard_n" ]
  then
    echo "TEST_SHARD must be i/n with 0 <= i < n, got ${TEST_SHARD}" >&2
    exit 2
  fi
fi
gpu_workers() {  # "-n GPU_WORKERS" (default 6: every GPU test file in about 4 minutes on one H100) where xdist imports
  [ "${GPU_WORKERS:-6}" != 0 ] && python3 -c "import xdist" 2>/dev/null && echo "-n ${GPU_WORKERS:-6}"
}
gpu_test_files() {  # "tests", or with TEST_SHARD=i/n the files with GPU tests whose (sorted) index is i mod n
  [ -z "${TEST_SHARD:-}" ] && { echo tests; return; }
  local i=$shard_i n=$shard_n
  grep -l "mark\.gpu" tests/test_*.py | sort | awk -v i="$i" -v n="$n" '(NR - 1) % n == i' | tr '\n' ' '
}
TRAIN="python3 -m distwgrad.launch.train --no-progress"
LARGE="$TRAIN --model large --log-every 1"
STEP="torchrun --standalone --nproc-per-node 1 qa/bench/train_step.py --model large --batch 8 --microbatches 1"
for step in $STEPS; do
  case $step in
    tests) STEP_TIMEOUT=${STEP_TIMEOUT:-580} run tests python3 -m pytest ${GPU_TESTS:-$(gpu_test_files)} -m gpu --full -q -p no:cacheprovider -rf --tb=short \
             --timeout 150 --durations 12 $(gpu_workers) ${PYTEST_ARGS:-} ;;
    te_swap)  # the files the TE drop-in is judged by; each case's outcome in the log
      for spec in "tied:test_tied_delayed_wgrad.py" "numerics:test_numerics.py -k delay_wgrad" \
                  "graphs:test_cuda_graphs.py -k interleaved_pipeline_parallelism or capture_time_hooks" \
                  "dw:test_distributed_weight.py test_ops_grouped_linear_distributed_weight.py"; do
        name=${spec%%:*} args=${spec#*:}
        case $args in *" -k "*) files=${args%% -k *} k=${args#* -k } ;; *) files=$args k= ;; esac
        run "te_$name" env TE_TESTS="$(cd "${TE_TESTS:-.te_tests}" 2>/dev/null && pwd || echo "${TE_TESTS:-.te_tests}")" \
          bash qa/te_swap/run.sh $files ${k:+-k "$k"} -q -rfE --tb=line
      done ;;
    cpu_full) run cpu_full env CUDA_VISIBLE_DEVICES= python3 -m pytest tests -m "not distributed and not gpu" --full \
                -q -p no:cacheprovider -n "${PYTEST_WORKERS:-auto}" -rf --tb=short ;;
    job) run job_bf16 $LARGE --precision bf16 --steps 4 --check-parity --out "$OUT_ABS/job_bf16"
         run job_fp8 $LARGE --precision bf16 --recipe fp8_per_tensor --steps 4 --out "$OUT_ABS/job_fp8"
         run job_graph $LARGE --precision bf16 --steps 4 --cuda-graph --check-parity --out "$OUT_ABS/job_graph"
         for recipe in none fp8_per_tensor; do
           run "job_compile_$recipe" $TRAIN --steps 4 --compile --cuda-graph --check-parity --recipe "$recipe" \
             --out "$OUT_ABS/job_compile_$recipe"
         done ;;
    job_recipes)  # a weight cache that outlived an optimizer step (a stale FP8 scale) fails the parity check
      for recipe in none fp8_per_tensor fp8_blockwise; do
        run "job_${recipe}_eager" $TRAIN --steps 20 --check-parity --recipe "$recipe" --out "$OUT_ABS/job_${recipe}_eager"
        run "job_${recipe}_graphed" $TRAIN --steps 20 --check-parity --recipe "$recipe" --compile --cuda-graph \
          --out "$OUT_ABS/job_${recipe}_graphed"
      done ;;
    bench) STEP_TIMEOUT=480 run bench $STEP --precisions bf16 --modes ${BENCH_MODES:-eager,compiled,compiled_cuda_graph} \
             --warmup 2 --rounds 6 --steps 2 ${BENCH_ARGS:-} ;;
    bench_fp8)  # one build a process: a host-bound FP8 build runs slower beside other builds (LOG.md)
      for p in bf16 fp8_per_tensor fp8_blockwise; do
        run "bench_fp8_$p" $STEP --impls distwgrad --precisions "$p" --modes "${FP8_MODES:-eager}" --warmup 2 \
          --rounds 3 --steps 3
      done ;;
    bench_recipes)  # FP8 / bf16 ratios from one process (the issue's measure); the FP8 rounds spread more (LOG.md)
      for mb in ${RECIPE_MB:-1 2}; do
        for mode in ${RECIPE_MODES:-eager compiled compiled_cuda_graph}; do
          run "bench_recipes_mb${mb}_$mode" ${STEP% --microbatches 1} --microbatches "$mb" --impls distwgrad \
            --precisions bf16,fp8_per_tensor,fp8_blockwise --modes "$mode" --warmup 2 --rounds 3 --steps 3
        done
      done ;;
    bench_best)
      for peer in fsdp2 torch; do
        STEP_TIMEOUT=480 run "bench_best_$peer" $STEP --precisions bf16 --impls "distwgrad,$peer" \
          --modes compiled,compiled_cuda_graph --together --warmup 2 --rounds 6 --steps 2
      done ;;
    bench_peers_fp8)
      for mode in ${PEER_MODES:-eager compiled}; do
        STEP_TIMEOUT=480 run "bench_peers_fp8_$mode" $STEP --precisions bf16,fp8_per_tensor --modes "$mode" --warmup 2 \
          --rounds 6 --steps 2
      done ;;
    bench_xl)  # ratios to bf16 from one process; the plain build's FP8 is torchao's
      for impl in ${XL_IMPLS:-distwgrad torch}; do
        precisions=bf16,fp8_per_tensor,fp8_blockwise
        [ "$impl" = torch ] && precisions=bf16,fp8_per_tensor
        STEP_TIMEOUT=580 run "bench_xl_$impl" torchrun --standalone --nproc-per-node 1 qa/bench/train_step.py \
          --model xl --batch 8 --microbatches "${XL_MB:-1}" --impls "$impl" --precisions "$precisions" \
          --modes "${XL_MODES:-eager,compiled_cuda_graph}" --warmup 2 --rounds 3 --steps 2
      done ;;
    layer) run layer python3 qa/bench/layer_step.py --impls distwgrad,torch
           run layer_graph python3 qa/bench/layer_step.py --moe 128,16384,2048,768 --embed --cuda-graph ;;
    kernels) run kernels_gemm python3 qa/bench/kernels.py gemm --rounds 3 ${KERNEL_ARGS:-}
             run kernels_fp8 python3 qa/bench/kernels.py fp8 ${KERNEL_ARGS:-} ;;
    sweep_gemm) run sweep_gemm python3 qa/bench/kernels.py gemm --sweep --json "$OUT_ABS/sweep_gemm.json" ;;
    sweep_fp8) run sweep_fp8 python3 qa/bench/kernels.py fp8 --benchmarks grouped_gemm --gemm-sweep \
                 --json "$OUT_ABS/sweep_fp8.json" ;;
    sweep_quant) run sweep_quant python3 qa/bench/kernels.py fp8 --benchmarks quantize --quant-sweep \
                   --json "$OUT_ABS/sweep_quant.json" ;;
    curves)  # docs/fp8.md "Loss curves"; the runs' folders stay out of OUT_DIR, only their reports come back
      for seed in ${CURVE_SEEDS:-0}; do
        reports=()
        for spec in ${CURVE_RUNS:-fp32:none bf16:none bf16:fp8_per_tensor bf16:fp8_blockwise}; do
          prec=${spec%%:*} recipe=${spec##*:} dir=${TMPDIR:-/tmp}/distwgrad_curves/s$seed/${spec/:/_}
          report="$OUT_ABS/curves/s${seed}_${spec/:/_}.json"
          [ -n "$DRY_RUN" ] || { rm -rf "$dir"; mkdir -p "$OUT_ABS/curves"; }
          STEP_TIMEOUT=580 run "curve_s${seed}_${spec/:/_}" $LARGE --global-batch 8 --microbatches 2 --log-every 25 \
            --steps "${CURVE_STEPS:-200}" --seed "$seed" --precision "$prec" --recipe "$recipe" --out "$dir" \
            $([ "$prec" = fp32 ] || echo "${CURVE_ARGS:-}")
          [ -f "$dir/report.json" ] && cp "$dir/report.json" "$report" && reports+=("$report")
        done
        [ ${#reports[@]} -ge 2 ] && run "curves_s$seed" python3 qa/bench/loss_curves.py "${reports[@]}"
      done ;;
    megatron) run megatron python3 qa/L2_gpu/megatron_real_schedule.py ;;
    tools) run fp8_audit python3 qa/L2_gpu/fp8_kernel_audit.py --recipe fp8_blockwise --steps 8 --out /tmp/fp8_audit
           run quant_gluon python3 qa/L2_gpu/rowcol_gluon_check.py
           run tma_alignment python3 qa/L2_gpu/tma_token_alignment.py ;;
    multi_gpu)
      run nccl_tests python3 -m pytest tests -m gpu -k nccl -q -p no:cacheprovider -rf --tb=short --timeout 280
      run job_2gpu torchrun --standalone --nproc-per-node 2 -m distwgrad.launch.train --steps 30 --check-parity \
        --no-progress --out "$OUT_ABS/job_2gpu"
      run megatron_2gpu torchrun --standalone --nproc-per-node 2 qa/L2_gpu/megatron_real_schedule.py ;;
    *) echo "unknown step $step (steps: $(echo $ALL))" >&2; RESULT[$step]=unknown; ORDER+=("$step") ;;
  esac
done
[ -n "$DRY_RUN" ] && exit 0
echo "== summary" | tee -a "$LOG"
for step in "${ORDER[@]}"; do echo "$step: ${RESULT[$step]}" | tee -a "$LOG"; done
