#!/usr/bin/env bash
# Lint and types: ruff over the tree, mypy over the runtime package.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m ruff check distwgrad kernels launch tests qa
python -m mypy distwgrad
