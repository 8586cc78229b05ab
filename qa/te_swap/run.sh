#!/usr/bin/env bash
# TransformerEngine's public test files, unedited, against distwgrad through the import swap (te_swap.py).
#
#   TE_TESTS=path/to/tests/pytorch bash qa/te_swap/run.sh test_tied_delayed_wgrad.py -k "not fp8"
#
# TE_TESTS: a folder holding TransformerEngine's tests/pytorch files (they are TE's, not part of this
# repository: copy them from a TransformerEngine checkout, utils.py with them). The arguments go to pytest.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "${TE_TESTS:?set TE_TESTS to a folder of TransformerEngine\'s tests/pytorch files}"
PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" exec python3 -m pytest -p te_swap -c /dev/null --rootdir . \
  -p no:cacheprovider "$@"
