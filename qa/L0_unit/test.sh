#!/usr/bin/env bash
# L0: single-process unit tests (CPU), including the Triton kernels under TRITON_INTERPRET=1.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash qa/_pytest.sh tests -m "not distributed and not gpu" -n "${PYTEST_WORKERS:-auto}" --dist worksteal -q "$@"
