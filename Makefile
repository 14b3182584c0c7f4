# wowd: `make run` (the daemon on the embedded default with a demo producer) and `make test`.
# Needs only python3 (>= 3.11) and make: the virtualenv is created from requirements.lock.

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# `make run` needs the runtime dependencies only (pinned by requirements.lock used as constraints);
# `make test` and the other targets add the test and bench extras.
RUNTIME_STAMP := $(VENV)/.runtime-stamp
STAMP := $(VENV)/.installed-stamp
# Every Python file of the tree is held to `ruff format`.
FORMATTED := wowd tests bench deploy
IMAGE ?= wowd:local

.PHONY: venv run test lint unit bench screenshots soak mutate lock image clean

$(RUNTIME_STAMP): pyproject.toml requirements.lock
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --constraint requirements.lock -e .
	touch $(RUNTIME_STAMP)

$(STAMP): $(RUNTIME_STAMP)
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

run: $(RUNTIME_STAMP)
	$(BIN)/wowd run --demo

lint: venv
	$(BIN)/ruff check wowd tests bench
	$(BIN)/ruff format --check $(FORMATTED)
	$(BIN)/mypy wowd
	@if docker compose version >/dev/null 2>&1; then GRAFANA_ADMIN_PASSWORD=lint docker compose -f deploy/compose.yaml config -q; \
	else echo "lint: docker compose plugin not installed, deploy/compose.yaml not validated by it"; fi

# Two workers (pytest-xdist) stealing work from each other; bytecode caches written (__pycache__/, ignored by git) even where
# PYTHONDONTWRITEBYTECODE is set: the suite starts over a hundred Python processes.
unit: venv
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n 2 --dist worksteal

test: lint unit

bench: venv
	$(BIN)/python -m bench

# The status page's screenshots in docs/img (the browser test, Debian's chromium and chromium-driver).
screenshots: venv
	WOWD_TEST_SCREENSHOTS=$(CURDIR)/docs/img WOWD_TEST_REQUIRE_BROWSER=1 $(BIN)/python -m pytest -q -n 0 tests/ui/test_status_page_browser.py

soak: venv
	$(BIN)/python -m tests.chaos.soak --minutes 30

# Mutation testing (mutmut, one mutant at a time, niced) of the modules where a silent change loses
# or repeats a timer; the groups and their fast tests are listed in tests/mutate.py. Not part of
# `make test`: each group takes minutes. GROUPS=retry (say) runs some only; docs/testing.md.
mutate: venv
	env -u PYTHONDONTWRITEBYTECODE nice -n 19 $(BIN)/python -m tests.mutate $(GROUPS)

# Re-pin requirements.lock after changing pyproject.toml dependencies.
lock: venv
	$(BIN)/python -m pip install -q uv
	$(BIN)/uv pip compile pyproject.toml --extra test --extra bench --extra mutate --python-version 3.11 -o requirements.lock

# The container image, labelled with its version, source repository and revision.
image:
	docker build -t $(IMAGE) \
	  --build-arg VERSION=$$(sed -n 's/^__version__ = "\(.*\)"/\1/p' wowd/__init__.py) \
	  --build-arg SOURCE=$$(git remote get-url origin 2>/dev/null | sed 's/\.git$$//') \
	  --build-arg REVISION=$$(git rev-parse HEAD 2>/dev/null) .

# Removes the virtualenv and tool caches; ./wowd.db (your data) is kept: delete it yourself.
clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
