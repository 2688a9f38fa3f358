# Both entry points create .venv at the repo root and install the project into it.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv test serve lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch; a bare "torch" requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,loadtest]'
	touch $(STAMP)

# Two workers, one per core of the CI machine; a test file stays on one worker (its module fixtures
# start Ray, Redis or an engine once). The fault tests time requests under load against thresholds,
# so they run afterwards on their own, not beside the other worker's CPU-bound kernels; so does the
# three-node cluster of tests/cluster (three raylets and a node killed under load).
test: venv
	$(PY) -m pytest -q -n 2 --dist loadfile --ignore=tests/faults --ignore=tests/cluster
	$(PY) -m pytest -q tests/faults tests/cluster

lint: venv
	$(VENV)/bin/ruff check antumbra tests benchmarks loadtest
	$(VENV)/bin/mypy antumbra

serve: venv
	$(VENV)/bin/antumbra serve $(ARGS)

clean:
	rm -rf $(VENV) .cache .pytest_cache
