#!/usr/bin/env bash
# The README's first command in a fresh virtual environment: it must need nothing but what it installs.
#
# The command is read from README.md's first ```bash block (so the two cannot drift) and run as written
# from the repository root, with `--steps 3 --out <temp dir>` appended (argparse takes the last value).
# Needs network access to the package index (torch is large); PYTHON picks the interpreter (python3).
set -euo pipefail
cd "$(dirname "$0")/.."

command=$(awk '/^```bash$/ {inside = 1; next} /^```$/ && inside {exit} inside' README.md)
case "$command" in
  "pip install "*" && torchrun "*) ;;
  *) echo "qa/fresh_install.sh: README.md's first bash block is not 'pip install ... && torchrun ...':" >&2
     echo "$command" >&2
     exit 1 ;;
esac

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"${PYTHON:-python3}" -m venv "$tmp/venv"
# shellcheck disable=SC1091
source "$tmp/venv/bin/activate"
echo "+ $command --steps 3 --out $tmp/out"
eval "$command --steps 3 --out \"$tmp/out\""
python - "$tmp/out/report.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
assert report["steps"] == [1, 2, 3] and report["summary"]["final_loss"] is not None, report["steps"]
print(f"fresh install: 3 steps, final loss {report['summary']['final_loss']:.4f}")
PY
test -f "$tmp/out/loss.png"
