# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || "$$(./scripts/find-python.sh)" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/crosstalk run $(ARGS)

test: $(STAMP)
	@./scripts/ensure-redis.sh
	@./scripts/ensure-chromium.sh
	$(VENV)/bin/ruff check proxy addons tests bench
	$(VENV)/bin/ruff format --check proxy addons tests bench
	$(VENV)/bin/pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/quality.py
	$(PY) bench/engine.py
	$(PY) bench/passthrough.py
	$(PY) bench/replay.py
	$(PY) bench/scaleout.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
