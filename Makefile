# The two commands of the README: `make demo` and `make test`. Both set up on first use.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed

.PHONY: demo test lint bench setup clean

$(STAMP): pyproject.toml constraints/dev.txt scripts/setup.sh constraints/peers.txt scripts/setup_peers.sh
	./scripts/setup.sh

setup: $(STAMP)

# The demo installs only what it runs (the test set-up above is a superset).
$(DEMO_STAMP): pyproject.toml constraints/dev.txt scripts/setup_demo.sh
	./scripts/setup_demo.sh

demo: $(DEMO_STAMP)
	$(VENV)/bin/metadist demo

test: $(STAMP) lint
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/mypy

# Peer libraries are benchmark anchors only: installed beside, never into, the package env.
BENCH_PKGS := .bench
$(BENCH_PKGS)/.installed-2: $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(BENCH_PKGS) fairscale==0.4.13
	$(PY) -m pip install -q --no-deps --ignore-requires-python --target $(BENCH_PKGS) betty-ml==0.2.1
	$(PY) -m pip install -q --no-deps --target $(BENCH_PKGS) torchopt==0.7.3 optree graphviz
	touch $@

# Every benchmark, each in its own process; tables, results.json and plots in out/bench/.
bench: $(STAMP) $(BENCH_PKGS)/.installed-2
	$(VENV)/bin/metadist bench --out out/bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info src/*.egg-info
