# Quick start: `make run` starts the server, `make test` runs the whole suite.
# Both create .venv and install into it; torch's CPU wheel is pinned first so that nothing
# pulls a multi-GB CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH := torch==2.13.0

.PHONY: install run test bench proto clean

$(VENV)/.installed: pyproject.toml setup.py kvstore/_copyhash.c
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[test,bench]'
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/kvstore-server --tiers host,ssd

test: install
	$(PY) -m pytest -q

bench: install
	$(VENV)/bin/kvstore-bench throughput

proto: install
	$(PY) -m kvstore.protogen

clean:
	rm -rf $(VENV) kvstore-data .pytest_cache
