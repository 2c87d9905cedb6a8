# The two commands of the README: `make demo` and `make test`. Both set up on first use.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench setup clean

$(STAMP): pyproject.toml constraints/dev.txt scripts/setup.sh
	./scripts/setup.sh

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/metadist demo

test: $(STAMP) lint
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info src/*.egg-info
