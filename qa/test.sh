#!/usr/bin/env bash
# The README's test command: L0 (unit) and L1 (multi-rank, gloo) in one pytest session, CPU only. One
# session collects once and keeps both cores busy to the end: xdist's work stealing hands a worker that
# has run out some of the other's queue (tests/conftest.py puts the long tests first). qa/L0_unit and
# qa/L1_distributed run either suite alone.
set -euo pipefail
cd "$(dirname "$0")/.."
# Two workers more than cores: many tests spend seconds waiting (ranks starting, a job's timeout, a stopped
# rank), and the extra workers fill that time (2 cores: 657 s with 2 workers, 620-635 s with 3, 618 s with 4;
# docs/benchmarks/LOG.md, 2026-12-05).
# One intra-op thread per process: the workers already fill the cores, and the tests' ranks, interpreter
# cases and subprocesses would otherwise each start as many OpenMP threads as there are cores (which spin
# while they wait) on top of them. The ranks set it themselves (distwgrad/testing/multiprocess.py).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Inductor compiles in this process, not in a pool of worker interpreters each of which imports torch: the tests
# compile small graphs in many short processes, where a pool's start costs more than it saves (the compiled
# job's test: 58 -> 49 s of CPU with a fresh cache).
export TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-1}"
bash qa/_pytest.sh tests -m "not gpu" -n "${PYTEST_WORKERS:-$(( $(nproc) + 2 ))}" --dist worksteal -q "$@"
