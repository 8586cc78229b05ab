#!/usr/bin/env bash
# L1: multi-rank tests on CPU (gloo ranks started by distwgrad.testing.multiprocess; each has a timeout).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash qa/_pytest.sh tests -m "distributed and not gpu" -n "${PYTEST_WORKERS:-2}" --dist worksteal -q "$@"
