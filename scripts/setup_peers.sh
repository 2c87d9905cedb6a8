#!/usr/bin/env bash
# The peers the test suite compares metadist with (Betty, TorchOpt, higher, learn2learn,
# FairScale), at the versions constraints/peers.txt pins, into .peers/ beside the package:
# tests put it on the path of the processes that run a peer, nothing else sees it.
# Idempotent: a stamp named after the pins' checksum says the set is complete.
set -euo pipefail
cd "$(dirname "$0")/.."

py=.venv/bin/python
pins=constraints/peers.txt
stamp=".peers/.installed-$(sha256sum "$pins" | cut -c1-16)"

pin() { grep -E "^$1==" "$pins" | head -n 1; }
pip_target() { "$py" -m pip install -q --disable-pip-version-check --no-deps --target "$@"; }

# TorchOpt's own test suite, from its source distribution (the wheel has no tests/):
# tests/test_torchopt_suite.py runs it against TorchOpt and against metadist.compat.torchopt.
# Extracted as shipped into .peers/torchopt-tests/ (the sdist is checked against its digest;
# its helpers.py, which the sdist lacks, is tests/torchopt_suite/helpers.py, written here).
torchopt_sdist_sha256=7b5f1628318a89891b14b7eecf26adde0e9c0590842a16a99fcaa09a91c59c56
torchopt_tests() {
    local dest=.peers/torchopt-tests dl=.peers-build/torchopt-sdist
    [ -f "$dest/.complete-$torchopt_sdist_sha256" ] && return 0
    rm -rf "$dest" "$dl"
    mkdir -p "$dl"
    # --no-build-isolation: only the archive is wanted; pip reads its metadata with the
    # venv's setuptools instead of resolving TorchOpt's build requirements.
    "$py" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
        --no-build-isolation --dest "$dl" "$(pin torchopt)"
    local archive
    archive=$(ls "$dl"/torchopt-*.tar.gz)
    echo "$torchopt_sdist_sha256  $archive" | sha256sum -c --quiet -
    tar -xzf "$archive" -C "$dl"
    mkdir -p "$dest"
    cp -r "$dl"/torchopt-*/tests/. "$dest"/
    rm -rf "$dl"
    touch "$dest/.complete-$torchopt_sdist_sha256"
}

if [ -f "$stamp" ]; then
    torchopt_tests
    exit 0
fi

rm -rf .peers .peers-build
mkdir -p .peers-build
echo "installing the peer libraries into .peers/ ($pins)"
# Betty 0.2.1 declares python<3.11 (it runs on 3.11); everything here is pure Python or a
# wheel for this interpreter, and --no-deps keeps torch and numpy the venv's own.
pip_target .peers --ignore-requires-python "$(pin betty-ml)"
pip_target .peers "$(pin torchopt)" "$(pin optree)" "$(pin graphviz)" "$(pin higher)" \
    "$(pin requests)" "$(pin urllib3)" "$(pin idna)" "$(pin charset-normalizer)" \
    "$(pin certifi)" "$(pin gym)" "$(pin gym-notices)" "$(pin cloudpickle)"
# JAX on the CPU, for the JAX comparisons of TorchOpt's test_implicit.py (numpy and scipy
# are the venv's own)
pip_target .peers "$(pin jax)" "$(pin jaxlib)" "$(pin jaxopt)" "$(pin optax)" \
    "$(pin ml-dtypes)" "$(pin opt-einsum)" "$(pin absl-py)"

# learn2learn: from its sdist, with the Cython extensions regenerated for this Python.
pip_target .peers-build/cython "$(pin cython)"
"$py" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
    --dest .peers-build "$(pin learn2learn)"
tar -xzf .peers-build/learn2learn-*.tar.gz -C .peers-build
src=$(ls -d .peers-build/learn2learn-*/)
rm -rf "$src/.eggs"
PYTHONPATH=.peers-build/cython "$py" -m cython -3 "$src"learn2learn/data/*.pyx
"$py" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
    --target .peers "$src"
# FairScale: its sdist, built here without CUDA (pure Python).
"$py" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
    --target .peers "$(pin fairscale)"
rm -rf .peers/tests .peers/bin .peers/benchmarks .peers-build  # sdists' own test packages
torchopt_tests
touch "$stamp"
