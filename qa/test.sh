#!/usr/bin/env bash
# The README's test command: L0 (unit) then L1 (multi-rank, gloo). CPU only.
set -euo pipefail
cd "$(dirname "$0")/.."
bash qa/L0_unit/test.sh
bash qa/L1_distributed/test.sh
