#!/usr/bin/env bash
# What `make demo` needs and nothing else: a virtual environment with metadist and the
# demo's extras (scikit-learn's digits, matplotlib), torch pinned to the CPU wheel by the
# constraints file. The test suite's set-up (scripts/setup.sh) is a superset. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints/dev.txt -e ".[demo]"
touch .venv/.demo-installed
