#!/usr/bin/env bash
# The system checks of one H200 in one device call: the job at the large preset (mixed precision with
# --check-parity, then FP8), the whole-step benchmark beside FSDP2 and plain torch, the layer benchmark,
# the dtype routes and the GPU tests of the runtime; and the CUDA-graphed step (--cuda-graph): the job at
# the large preset with --check-parity, the whole step and the E=128 MoE layer graphed beside eager, and
# its GPU tests. Each step has a time limit and its exit code goes to the summary; logs and rows land in
# OUT_DIR (default $OUT, else runs/gpu_system). Usage:
#
#   bash qa/L2_gpu/system.sh                       # every step
#   STEPS="job_bf16 bench_bf16" bash qa/L2_gpu/system.sh
#   STEPS="graph_tests job_graph bench_graph layer_graph" bash qa/L2_gpu/system.sh   # the graphed step
#   STEPS="fp8_tests bench_fp8" bash qa/L2_gpu/system.sh   # FP8: tests, then each precision's eager step in
#                                             # a process of its own (FP8_MODES=compiled: the compiled ones)
#   STEPS=curves CURVE_SEEDS="0 1" CURVE_STEPS=200 bash qa/L2_gpu/system.sh   # (not in the default) the FP8
#       loss bound's four runs a seed at the large preset, then qa/bench/loss_curves.py; each run's report
#       lands in $OUT_DIR/curves/s<seed>_<precision>_<recipe>.json (CURVE_RUNS picks some of the four, for
#       runs spread over several calls; compare the reports afterwards with loss_curves.py)
#       CURVE_ARGS="--compile --cuda-graph" adds those flags to the bf16 and FP8 runs (the fp32 one cannot be
#       graphed)
#   STEPS=job_recipes bash qa/L2_gpu/system.sh   # the job (tiny preset, fused AdamW) with --check-parity, 20 steps,
#       each recipe (none, fp8_per_tensor, fp8_blockwise) eager and with --compile --cuda-graph
#   STEPS=job_compile bash qa/L2_gpu/system.sh   # the job with --compile --cuda-graph --check-parity, bf16 and
#       per-tensor FP8 (tiny preset)
#   STEPS=bench_best bash qa/L2_gpu/system.sh   # (not in the default) the bf16 targets' best configurations
#       in one group of rotated rounds each (train_step.py --together): distwgrad compiled and graphed beside
#       FSDP2 compiled, then beside plain torch compiled and graphed (all of a group alive at once)
#   STEPS=fp8_wgrad bash qa/L2_gpu/system.sh   # (not in the default) the FP8 wgrad kernels: their GPU tests
#       (Gluon against Triton, bit for bit, both recipes), the blockwise wgrad timed beside its Triton kernel
#       (qa/bench/kernels.py fp8), and the layer step's FP8 recipes against bf16 (qa/bench/layer_step.py)
#   STEPS=multi_build bash qa/L2_gpu/system.sh   # (not in the default) per-tensor eager alone, beside the
#       bf16 and blockwise builds in one process, then alone again: one machine start, so the host's speed
#       is the same for the three
#
# On a machine whose copy of the tree has no .git of its own, pass the source commit:
#   DISTWGRAD_COMMIT=<git rev-parse --short HEAD, where the tree came from> bash qa/L2_gpu/system.sh
# Rows are appended to $OUT_DIR/results.jsonl (DISTWGRAD_RESULTS); append them to
# docs/benchmarks/results.jsonl and run `PYTHONPATH=. python qa/bench/report.py` to publish them.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT_DIR=${OUT_DIR:-${OUT:-runs/gpu_system}}
mkdir -p "$OUT_DIR"
case $OUT_DIR in /*) OUT_ABS=$OUT_DIR ;; *) OUT_ABS=$PWD/$OUT_DIR ;; esac
export DISTWGRAD_RESULTS=${DISTWGRAD_RESULTS:-$OUT_ABS/results.jsonl}
STEPS=${STEPS:-"job_bf16 job_fp8 tests fp8_tests bench_bf16 bench_fp8 layer graph_tests job_graph job_compile bench_graph layer_graph"}
STEP_TIMEOUT=${STEP_TIMEOUT:-240}
if ! python3 -c "import distwgrad.kernels" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT_DIR/install.log" 2>&1
fi
python3 -c "import distwgrad.kernels" || { echo "distwgrad.kernels does not import; see install.log"; exit 1; }
LOG="$OUT_DIR/system.log"
: >"$LOG"
declare -A RESULT
ORDER=()
run() {
  local name=$1; shift
  ORDER+=("$name")
  echo "== $name: $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$STEP_TIMEOUT" "$@" >>"$LOG" 2>&1
  RESULT[$name]="rc=$? $((SECONDS - t0))s"
  echo "   ${RESULT[$name]}" | tee -a "$LOG"
}
TRAIN="torchrun --standalone --nproc-per-node 1 -m distwgrad.launch.train --model large --log-every 1 --no-progress"
for step in $STEPS; do
  case $step in
    job_bf16) run job_bf16 $TRAIN --precision bf16 --steps 4 --check-parity --out "$OUT_ABS/job_bf16" ;;
    job_train) run job_train $TRAIN --precision bf16 --steps ${JOB_STEPS:-30} --log-every 5 --out "$OUT_ABS/job_train" ;;
    job_fp8) run job_fp8 $TRAIN --precision bf16 --recipe fp8_per_tensor --steps 4 --out "$OUT_ABS/job_fp8" ;;
    tests) run tests python3 -m pytest -q -p no:cacheprovider -m gpu ${GPU_TESTS:-tests/test_kernel_threads.py \
             tests/test_cuda_graphs.py tests/test_gpu_modules.py tests/test_mixed_precision.py \
             tests/test_gradient_memory.py tests/test_layernorm_mlp.py tests/test_grouped_gemm_routes.py} ;;
    # 6 rounds: with 2 or 3 builds each is timed in each place of a round equally often (train_step.py,
    # [Note: each build in each place of a round])
    bench_bf16) STEP_TIMEOUT=${BENCH_TIMEOUT:-480} run bench_bf16 torchrun --standalone --nproc-per-node 1 qa/bench/train_step.py --model large \
                  --batch 8 --microbatches 1 --precisions bf16 --modes ${BENCH_MODES:-eager,compiled,compiled_cuda_graph} \
                  --warmup 2 --rounds 6 --steps 2 ${BENCH_ARGS:-} ;;
    bench_best)
      for peer in fsdp2 torch; do
        STEP_TIMEOUT=${BENCH_TIMEOUT:-480} run "bench_best_$peer" torchrun --standalone --nproc-per-node 1 \
          qa/bench/train_step.py --model large --batch 8 --microbatches 1 --precisions bf16 \
          --impls "distwgrad,$peer" --modes compiled,compiled_cuda_graph --together --warmup 2 --rounds 6 --steps 2
      done ;;
    bench_fp8)  # one build a process: a host-bound FP8 build runs slower beside other builds (LOG.md)
      for p in ${FP8_PRECISIONS:-bf16 fp8_per_tensor fp8_blockwise}; do
        run "bench_fp8_$p" torchrun --standalone --nproc-per-node 1 qa/bench/train_step.py --model large \
          --batch 8 --microbatches 1 --impls distwgrad --precisions "$p" --modes ${FP8_MODES:-eager} \
          --warmup 2 --rounds 3 --steps 3 ${FP8_ARGS:-}
      done ;;
    fp8_wgrad)
      run fp8_wgrad_tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_grouped_gemm_fp8_gpu.py -k wgrad
      run fp8_wgrad_bench python3 qa/bench/kernels.py fp8 --benchmarks grouped_gemm --gemm-ops wgrad_accumulate \
        --gemm-recipes blockwise per_tensor
      run fp8_wgrad_layer python3 qa/bench/layer_step.py ;;
    fp8_tests) run fp8_tests python3 -m pytest -q -p no:cacheprovider -m gpu ${FP8_TESTS:-tests/test_weights_fp8.py \
                 tests/test_fp8_gemm_dispatch.py tests/test_token_layout.py tests/test_cast_transpose.py tests/test_fp8_capture.py} ;;
    curves)  # docs/fp8.md "Loss curves"; the runs' folders stay out of OUT_DIR, only their reports come back
      mkdir -p "$OUT_ABS/curves"
      for seed in ${CURVE_SEEDS:-0}; do
        for spec in ${CURVE_RUNS:-fp32:none bf16:none bf16:fp8_per_tensor bf16:fp8_blockwise}; do
          prec=${spec%%:*} recipe=${spec##*:} dir=${TMPDIR:-/tmp}/distwgrad_curves/s$seed/${spec/:/_}
          rm -rf "$dir"  # a run that fails must not leave an earlier call's report to be taken for its own
          STEP_TIMEOUT=${CURVE_TIMEOUT:-580} run "curve_s${seed}_${spec/:/_}" $TRAIN --global-batch 8 \
            --microbatches 2 --steps "${CURVE_STEPS:-200}" --seed "$seed" --precision "$prec" --recipe "$recipe" \
            --log-every 25 --out "$dir" $([ "$prec" = fp32 ] || echo "${CURVE_ARGS:-}")
          [ -f "$dir/report.json" ] && cp "$dir/report.json" "$OUT_ABS/curves/s${seed}_${spec/:/_}.json"
        done
        reports=()
        for name in fp32_none bf16_none bf16_fp8_per_tensor bf16_fp8_blockwise; do
          [ -f "$OUT_ABS/curves/s${seed}_$name.json" ] && reports+=("$OUT_ABS/curves/s${seed}_$name.json")
        done
        if [ ${#reports[@]} -ge 2 ]; then run "curves_s$seed" python3 qa/bench/loss_curves.py "${reports[@]}"; fi
      done ;;
    multi_build)
      MB="torchrun --standalone --nproc-per-node 1 qa/bench/train_step.py --model large --batch 8 --microbatches 1
          --impls distwgrad --modes eager --warmup 2 --rounds 3 --steps 3"
      run multi_alone $MB --precisions fp8_per_tensor
      run multi_beside $MB --precisions bf16,fp8_per_tensor,fp8_blockwise
      run multi_alone_again $MB --precisions fp8_per_tensor ;;
    layer) run layer python3 qa/bench/layer_step.py ;;
    graph_tests) run graph_tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_train_cuda_graph.py ;;
    job_graph) run job_graph $TRAIN --precision bf16 --steps ${GRAPH_JOB_STEPS:-4} --cuda-graph --check-parity \
                 --out "$OUT_ABS/job_graph" ;;
    job_compile)  # compiled blocks, graphed, held to the lockstep reference (docs/training.md)
      for recipe in none fp8_per_tensor; do
        run "job_compile_$recipe" python3 -m distwgrad.launch.train --steps 4 --compile --cuda-graph --check-parity \
          --recipe "$recipe" --no-progress --out "$OUT_ABS/job_compile_$recipe"
      done ;;
    job_recipes)  # the job's fused AdamW (CUDA) held to the lockstep reference, each recipe, eager and graphed:
      # a cache of the weight that outlived an optimizer step (a stale FP8 scale) fails the weight comparison
      for recipe in none fp8_per_tensor fp8_blockwise; do
        for mode in eager graphed; do
          run "job_${recipe}_$mode" python3 -m distwgrad.launch.train --steps ${RECIPE_STEPS:-20} --check-parity \
            --recipe "$recipe" --no-progress --out "$OUT_ABS/job_${recipe}_$mode" \
            $([ $mode = graphed ] && echo --compile --cuda-graph)
          python3 -c "import json,sys; p=json.load(open(sys.argv[1]))['parity']; print('   parity', p['passed'], \
            {k: f'{v:.1e}' for k, v in p['max'].items()})" "$OUT_ABS/job_${recipe}_$mode/report.json" 2>&1 | tee -a "$LOG"
        done
      done ;;
    bench_graph) run bench_graph torchrun --standalone --nproc-per-node 1 qa/bench/train_step.py --model large \
                   --batch 8 --microbatches 1 --precisions ${GRAPH_PRECISIONS:-bf16} --modes eager \
                   --cuda-graph --warmup 2 --rounds 6 --steps 2 ${GRAPH_ARGS:-} ;;
    layer_graph) run layer_graph python3 qa/bench/layer_step.py --moe 128,16384,2048,768 --embed --cuda-graph ;;
    *) echo "unknown step $step" | tee -a "$LOG"; RESULT[$step]="unknown"; ORDER+=("$step") ;;
  esac
done
echo "== summary" | tee -a "$LOG"
for step in "${ORDER[@]}"; do echo "$step: ${RESULT[$step]}" | tee -a "$LOG"; done
