# Every target bootstraps what it needs: a virtualenv in .venv, CRIU >= 4.2.1 and (for the
# web page tests) Chromium.
VENV    ?= .venv
PYTHON  ?= python3
BIN      = $(VENV)/bin
STAMP    = $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
PYTEST_ARGS ?=
## Test processes (pytest-xdist): each file's tests stay on one worker (tests/conftest.py).
## Three on the 2-core CI machine: most of a CRIU test's time is waiting on real processes
## (parallel pass 7:34 against 10:45 with two). Earlier three-process runs failed tests whose
## work directories another test's agent, in a PID namespace of its own, swept as a killed
## operation's (fixed: spotguard.workdirs judges only its own namespace). Four since
## 2026-11-28: the same pass took 12:43 against 13:47 with three on a slower day of the same
## machine (CPU 163 %: the tests still wait more than they compute), and CI had gone past
## 20 minutes with three.
TEST_WORKERS ?= 4
XDIST    = -n $(TEST_WORKERS) --dist loadgroup

.PHONY: demo test prereqs lint typecheck unit gpu-test bench criu chromium podman containerd docker registry venv clean

venv: $(STAMP)

## uv (from PyPI, into the venv) installs the rest: pip took ~2 minutes resolving and
## unpacking checkov's tree on the 2-core CI machine, uv ~20 s, to the same versions. No
## --compile-bytecode: compiling all of the ~700 MB tree took 32 s of a 40 s install, while
## compiling only what gets imported, on first import, costs under a second (checkov's first
## run 9.1 s against 9.8 s compiled ahead; the suite's imports 6.3 against 5.5 s). Where uv
## cannot be had or fails, pip installs as before. python-hcl2 and checkov's fork of it,
## bc-python-hcl2, both install a package named `hcl2`, and the one written last wins: pip
## writes the fork last (the suite's Terraform readers are written against it, `START_LINE`
## included); uv writes packages at once, so the fork is written again, last.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q uv \
	  && $(BIN)/uv pip install -q --python $(BIN)/python -e '.[dev]' \
	  && $(BIN)/uv pip install -q --python $(BIN)/python \
	    --reinstall-package bc-python-hcl2 bc-python-hcl2 \
	  || $(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -c 'import hcl2; hcl2.START_LINE'  # the fork's hcl2, as pip leaves it
	rm -f $(VENV)/.installed-*; touch $@

criu:
	@scripts/install-criu >/dev/null

## podman, conmon and runc from the distribution in a private prefix, for tests/container.
podman:
	@scripts/install-podman >/dev/null

## containerd, its runc shim and runc from the distribution in a private prefix, for
## tests/container (the tests start their own daemon; a host's containerd is never touched).
containerd:
	@scripts/install-containerd >/dev/null

## dockerd and docker from the distribution in a private prefix (with containerd's), for
## tests/container (the tests start their own dockerd; a host's docker is never touched).
docker: containerd
	@scripts/install-docker >/dev/null

## The distribution's docker-registry in a private prefix, for the containerd pull test (the
## test starts its own on 127.0.0.1; nothing is installed on the host).
registry:
	@scripts/install-registry >/dev/null

## Debian's chromium for tests/ui; when it cannot be installed those tests skip, saying why.
chromium:
	-@scripts/install-chromium >/dev/null

## The main job on the embedded default: no cloud account needed.
demo: venv criu
	$(BIN)/spotguard demo

## What the parallel pass needs, made at once: the venv's install, CRIU's build and Chromium's
## install each wait on something else (downloads, the compiler, dpkg). On a fresh 2-core
## machine one after another they took ~2 minutes of CI's 20 (the venv 48 s, CRIU's build
## 51 s, Chromium's ~25 s); the venv and CRIU at once took 77 s.
prereqs:
	@$(MAKE) --no-print-directory -j3 venv criu chromium

## The whole test suite (lint, types, tests). This is what CI runs: scripts/test-passes runs
## everything but the `serial` tests on TEST_WORKERS processes with mypy beside them, then the
## `serial` tests alone. The container runtimes, which only the serial pass uses
## (tests/container), are installed beside the parallel pass (PREPARE_SERIAL).
test: prereqs
	@$(MAKE) --no-print-directory lint
	PYTEST=$(BIN)/pytest MYPY=$(BIN)/mypy TEST_WORKERS=$(TEST_WORKERS) \
	  PREPARE_SERIAL='make --no-print-directory podman containerd docker registry' \
	  scripts/test-passes $(PYTEST_ARGS)

## The fast tier: no CRIU, no GPU (tests needing CRIU are marked criu by tests/conftest.py).
unit: venv
	$(BIN)/pytest -m "not criu and not gpu and not slow and not serial" $(XDIST) $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

typecheck: venv
	$(BIN)/mypy

## GPU tests: run on a machine with an NVIDIA GPU (driver >= 570).
gpu-test: venv criu
	scripts/gpu-tests

bench: venv criu
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
