#!/usr/bin/env bash
# The README's commands in a fresh virtual environment: they must need nothing but what they install.
#
# The first command is read from README.md's first ```bash block (so the two cannot drift) and run as
# written from the repository root, with `--steps 3 --out <temp dir>` appended (argparse takes the last
# value). Then the README's text-to-samples block (the one that runs prepare_data), line by line in a
# folder holding copies of README.md and docs/, each training line with a short `--steps` appended.
# Needs network access to the package index (torch is large); PYTHON picks the interpreter (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

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

text_block=$(awk '/^```bash$/ {inside = 1; block = ""; next}
                  /^```$/ && inside {inside = 0; if (block ~ /prepare_data/) {printf "%s", block; exit}; next}
                  inside {block = block $0 "\n"}' README.md)
[ -n "$text_block" ] || { echo "qa/fresh_install.sh: README.md has no bash block running prepare_data" >&2; exit 1; }
mkdir "$tmp/text"
cp -r README.md docs "$tmp/text/"
cd "$tmp/text"
steps=3
while IFS= read -r line; do
  [ -n "$line" ] || continue
  case "$line" in
    *distwgrad.launch.train*) line="$line --steps $steps"; steps=$((steps + 2)) ;;
    "pip install "*) line="(cd \"$repo\" && $line)" ;;  # installs this checkout
  esac
  echo "+ $line"
  eval "$line" </dev/null
done <<<"$text_block"
python - runs/docs/report.json <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
assert report["steps"] == [1, 2, 3, 4, 5] and report["val_steps"] == [3, 5], (report["steps"], report["val_steps"])
print(f"fresh install, text to samples: 5 steps over a resume, validation loss {report['val_loss'][-1]:.4f}")
PY
test -f runs/docs/export/model.safetensors
