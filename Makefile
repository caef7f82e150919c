# The two quickstart commands (README): `make run` runs the main job (the simulator re-running the FedExP paper's
# linear regression), `make test` the whole test suite. `make demo` times one aggregation round per backend.
# Each creates .venv on first use and installs what it needs: the CPU build of torch 2.13.0 first (a bare
# `torch` would pull the multi-GB CUDA build), then fastagg itself (editable: compiles fastagg._C).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
TRITON ?= triton==3.7.1

.PHONY: run demo test test-asan bench flower-example clean

$(VENV)/.installed: pyproject.toml setup.py $(wildcard csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH) $(TRITON)
	$(PY) -m pip install -q -e '.[test,sim]'
	touch $@

run: $(VENV)/.installed
	$(PY) -m fastagg.sim --dataset fedexp-linreg --algorithm fedexp,fedavg --rounds 200 --target 1e-4 --overwrite --out runs/fedexp-linreg

demo: $(VENV)/.installed
	$(PY) -m fastagg.demo

# Triton kernels run on the CPU through the interpreter; it must be set before triton is imported.
test: $(VENV)/.installed
	TRITON_INTERPRET=1 $(PY) -m pytest -q

# The C++ kernels under AddressSanitizer + UBSan (fastagg._C_asan): a canary proves the sanitizer is active, then
# the C++-backend tests run against the sanitized module (.ci/asan.sh). CI runs it after `make test`.
test-asan: $(VENV)/.installed
	PY=$(PY) bash .ci/asan.sh

# The Flower example app (examples/flower) in Flower's in-process simulation: 4 clients, fastagg's FedExP.
flower-example: $(VENV)/.installed
	$(PY) examples/flower/simulate.py --strategy fedexp --rounds 5 --clients 4

bench: $(VENV)/.installed
	$(PY) -m pytest bench --benchmark-enable --benchmark-only --benchmark-columns=min,median,iqr,ops

clean:
	rm -rf $(VENV) build fastagg/*.so *.egg-info
