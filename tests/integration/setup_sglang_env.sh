#!/usr/bin/env bash
# Test support, not part of the package: create (or reuse) the separate virtual environment in which the
# integration tier runs a real SGLang server on the CPU (see tests/integration/README.md).
#
#   tests/integration/setup_sglang_env.sh [VENV_DIR]     (default: .venv-sglang at the repository root)
#
# Installs torch==2.14.1 + torchvision==0.29.1 (the torch the project pins; a torchvision built for another
# torch fails to import), SGLang's non-CUDA requirements (sglang-0.5.23-cpu-requirements.txt beside this
# script: sglang 0.5.23's own requirement list minus torch, triton and the CUDA-only packages), then
# sglang==0.5.23 and sglang-router==0.3.2 without their dependencies. Idempotent: a stamp file records the
# inputs, and a second run with the same inputs does nothing. First run: a few minutes and several GB.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${1:-$ROOT/.venv-sglang}"
PYTHON="${PYTHON:-python3}"
REQS="$HERE/sglang-0.5.23-cpu-requirements.txt"
PINS="torch==2.14.1 torchvision==0.29.1 sglang==0.5.23 sglang-router==0.3.2"
STAMP="$VENV/.stamp-sglang"
want="$(cat "$REQS" "$HERE/setup_sglang_env.sh" | sha256sum | cut -d' ' -f1) $PINS"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -x "$VENV/bin/python" ]]; then
  echo "setup_sglang_env: $VENV is up to date"
  exit 0
fi
start=$(date +%s)
rm -f "$STAMP"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" torch==2.14.1 torchvision==0.29.1
"${PIP[@]}" -r "$REQS" torch==2.14.1 torchvision==0.29.1
"${PIP[@]}" --no-deps sglang==0.5.23 sglang-router==0.3.2
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, torchvision  # noqa: F401  (a mismatched torchvision fails here)
for pkg in ("torch", "torchvision", "sglang", "sglang-router", "transformers"):
    print(f"  {pkg} {md.version(pkg)}")
PY
echo "$want" > "$STAMP"
echo "setup_sglang_env: $VENV ready in $(( $(date +%s) - start )) s"
