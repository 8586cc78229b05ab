#!/usr/bin/env bash
# Runs pytest with the given arguments; "no tests collected" (exit 5) counts as success only when the
# caller says so with ALLOW_EMPTY=1 (a GPU-less machine running the GPU suite, say).
set -uo pipefail
python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  if [ "${ALLOW_EMPTY:-0}" = "1" ]; then
    echo "pytest collected no tests for: $*" >&2
    exit 0
  fi
  echo "pytest collected no tests for: $* (this suite must not be empty)" >&2
fi
exit "$rc"
