#!/usr/bin/env bash
# One-time set-up on a fresh machine: Debian packages the tests need, then a virtual
# environment with metadist and its pinned development dependencies, and the peer libraries
# the tests compare with (scripts/setup_peers.sh). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v mpirun >/dev/null 2>&1; then
    sudo_cmd=""
    if [ "$(id -u)" -ne 0 ]; then sudo_cmd="sudo"; fi
    echo "installing Debian's openmpi-bin (for the mpirun tests)"
    $sudo_cmd apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -q --no-install-recommends openmpi-bin
fi

python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
# The constraints file pins torch to the CPU wheel these machines hold (no CUDA download).
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints/dev.txt -e ".[dev,demo]"
# The peers the suite compares with, beside the package (.peers/).
./scripts/setup_peers.sh
touch .venv/.installed .venv/.demo-installed
