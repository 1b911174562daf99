# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml setup.py $(wildcard proxy/*/*.pyx) $(wildcard proxy/*/*.pxd)
	@test -x $(PY) || "$$(./scripts/find-python.sh)" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@# An editable install leaves the package uncompiled, and where PYTHONDONTWRITEBYTECODE
	@# is set every process (each test's proxy, each replay) compiles it again: ~0.13 s.
	@# A wheel's install compiles it; so does this.
	$(PY) -m compileall -q proxy addons
	@touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/crosstalk run $(ARGS)

test: $(STAMP)
	@./scripts/ensure-redis.sh
	@./scripts/ensure-chromium.sh
	@./scripts/ensure-llama-server.sh >/dev/null
	@./scripts/ensure-gemma.sh >/dev/null
	$(VENV)/bin/ruff check proxy addons tests bench
	$(VENV)/bin/ruff format --check proxy addons tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# Every benchmark runs; the target fails if any of them missed a target.
bench: $(STAMP)
	@status=0; for b in quality engine passthrough replay replay_jobs scaleout ingest; do \
	    $(PY) bench/$$b.py || { echo "bench/$$b.py: target missed" >&2; status=1; }; \
	done; exit $$status

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
