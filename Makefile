# wowd: `make run` (the daemon on the embedded default with a demo producer) and `make test`.
# Needs only python3 (>= 3.11) and make: the virtualenv is created from requirements.lock.

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: venv run test lint unit bench soak lock clean

$(STAMP): pyproject.toml requirements.lock
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

run: venv
	$(BIN)/wowd run --demo

lint: venv
	$(BIN)/ruff check wowd tests bench
	$(BIN)/mypy wowd
	@if docker compose version >/dev/null 2>&1; then docker compose -f deploy/compose.yaml config -q; \
	else echo "lint: docker compose plugin not installed, deploy/compose.yaml not validated by it"; fi

unit: venv
	$(BIN)/python -m pytest -q

test: lint unit

bench: venv
	$(BIN)/python -m bench

soak: venv
	$(BIN)/python -m tests.chaos.soak --minutes 30

# Re-pin requirements.lock after changing pyproject.toml dependencies.
lock: venv
	$(BIN)/python -m pip install -q uv
	$(BIN)/uv pip compile pyproject.toml --extra test --extra bench --python-version 3.11 -o requirements.lock

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache wowd.db wowd.db-wal wowd.db-shm
