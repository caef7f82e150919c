# The two quickstart commands (README): `make run` runs the main job (the simulator re-running the FedExP paper's
# linear regression), `make test` the whole test suite. `make demo` times one aggregation round per backend.
# Each creates .venv on first use and installs what it needs: the CPU build of torch 2.13.0 first, then fastagg
# itself (editable: compiles fastagg._C).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch's CPU build. On Linux x86-64 the public index's `torch==2.13.0` is the CUDA build with 18 nvidia-* / cuda-*
# packages (.ci/torch_index.sh checks both facts against the public index); the CPU build is `2.13.0+cpu`, served by
# PyTorch's CPU index (TORCH_INDEX) or by a local wheel store pip is configured to read. Without either the install
# fails: it never falls back to the CUDA build. On a GPU machine or macOS: make TORCH=torch==2.13.0 TORCH_INDEX=
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PIP = $(TORCH) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
# (torch is installed alone from there, --no-deps, then its dependencies from the default index: with the extra
# index on the whole install every dependency was looked up there too, retried 5 times each where it is unreachable)
TRITON ?= triton==3.7.1

.PHONY: run demo test test-large test-asan test-nvflare test-package bench flower-example mutation clean print-torch

# pip's progress stays on: the first install takes ~6 minutes here (torch, Flower with ray, the C++ build).
$(VENV)/.installed: pyproject.toml setup.py $(wildcard csrc/*)
	@echo "== creating $(VENV) and installing $(TORCH) $(TRITON), then fastagg with its test and simulator extras"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install --no-deps $(TORCH_PIP)
	$(PY) -m pip install $(TORCH) $(TRITON)
	@echo "== fastagg (editable: compiles fastagg._C, fastagg._C_avx2 and fastagg._tensor_facts, about 2 minutes)"
	# --no-build-isolation: the build sees this venv's torch, which fastagg._tensor_facts is compiled against (an
	# isolated build has no torch and leaves it out: the per-entry checks then run in Python); so the build's own
	# requirements (pyproject.toml [build-system]) are installed here first
	$(PY) -m pip install 'setuptools>=77' 'pybind11>=2.12'
	$(PY) -m pip install --no-build-isolation -e '.[test,sim]'
	touch $@

run: $(VENV)/.installed
	$(PY) -m fastagg.sim --dataset fedexp-linreg --algorithm fedexp,fedavg --rounds 200 --target 1e-4 --overwrite --out runs/fedexp-linreg

demo: $(VENV)/.installed
	$(PY) -m fastagg.demo

# Triton kernels run on the CPU through the interpreter; it must be set before triton is imported. The tests run
# on TEST_JOBS pytest-xdist workers (2: this machine kind's cores; 25 -> 16 minutes here); TEST_JOBS=0 runs them in
# one process with a line per test file. The 15 slowest tests at the end.
TEST_JOBS ?= 2
test: $(VENV)/.installed
	TRITON_INTERPRET=1 $(PY) -m pytest -n $(TEST_JOBS) --durations=15

# The cases too large for make test's memory budget (under 6 GB): a 2^31 + 5 element row and its 8.6 GB mean
# (13 GB). CI runs it on its 24 GB machine.
test-large: $(VENV)/.installed
	FASTAGG_FULL=1 $(PY) -m pytest -q tests/test_round.py -k "64bit_offsets_beyond_2_31_elements"

# The C++ kernels under AddressSanitizer + UBSan (fastagg._C_asan): a canary proves the sanitizer is active, then
# the C++-backend tests run against the sanitized module (.ci/asan.sh). CI runs it after `make test`.
test-asan: $(VENV)/.installed
	PY=$(PY) bash .ci/asan.sh

# The package as users install it: sdist -> wheel built from the sdist alone -> a fresh venv -> one fused step
# imported from another directory (.ci/package.sh). CI runs it.
test-package: $(VENV)/.installed
	PY=$(PY) TORCH='$(TORCH)' TORCH_INDEX='$(TORCH_INDEX)' bash .ci/package.sh

# What `make` asks pip for torch (.ci/torch_index.sh resolves it against the public index alone)
print-torch:
	@echo '$(TORCH_PIP)'

# fastagg.nvflare in an environment of its own, for the install form (nvflare 2.9.0 and flwr 1.42 resolve together
# with no conflict: protobuf 6.33 satisfies both; pip's dry run of nvflare into .venv changes no package): the aggregator driven
# directly and inside `nvflare simulator` (tests_nvflare/). fastagg is installed as a package, not editable: FLARE's
# job export copies a component's non-site-packages sources into the job, which would shadow an editable checkout.
# FASTAGG_WHEEL=path installs that wheel (CI: the one test-package built from the sdist) instead of building again.
NVFLARE_VENV ?= .venv-nvflare
NVPY := $(NVFLARE_VENV)/bin/python
$(NVFLARE_VENV)/.installed: pyproject.toml setup.py $(wildcard csrc/*) $(shell find fastagg -name '*.py')
	test -x $(NVPY) || $(PYTHON) -m venv $(NVFLARE_VENV)
	$(NVPY) -m pip install --upgrade pip
	$(NVPY) -m pip install --no-deps $(TORCH_PIP)
	$(NVPY) -m pip install $(TORCH)
	$(NVPY) -m pip install 'nvflare==2.9.0' pytest
	# FLARE's quantization filters import bitsandbytes (tests_nvflare/test_blockwise8.py runs them on the CPU);
	# --no-deps: its requirements (torch, numpy, packaging) are already here, and pip must not swap the torch build
	$(NVPY) -m pip install --no-deps 'bitsandbytes==0.50.2'
	$(NVPY) -m pip install --no-deps --force-reinstall $(if $(FASTAGG_WHEEL),$(FASTAGG_WHEEL),.)
	touch $@

test-nvflare: $(NVFLARE_VENV)/.installed
	cd tests_nvflare && ../$(NVPY) -m pytest -q -p no:cacheprovider -o addopts=-ra --rootdir . .

# The Flower example app (examples/flower) as Flower 1.42 runs apps locally: `flwr run` into a managed local
# SuperLink in simulation mode, Flower's defaults otherwise; 4 clients, fastagg's FedExP.
flower-example: $(VENV)/.installed
	$(PY) examples/flower/run_local.py --strategy fedexp --rounds 5 --clients 4

# The benchmarks (~15 minutes on 2 cores), their JSON in $(BENCH_JSON), then bench/report.py's tables and its summary
# of the interleaved ratios the README quotes. Run it on a quiet machine.
BENCH_JSON ?= .benchmarks/make-bench.json
bench: $(VENV)/.installed
	mkdir -p $(dir $(BENCH_JSON))
	$(PY) -m pytest bench --benchmark-enable --benchmark-only --benchmark-columns=min,median,iqr,ops \
	    --benchmark-json=$(BENCH_JSON)
	$(PY) bench/report.py $(BENCH_JSON)

# Mutation testing (not in CI; ~30 minutes on 2 cores): tools/mutation/run.py applies each curated plausible bug of
# tools/mutation/mutants.toml to a temporary copy of the repository (never to the checkout), runs the tests that
# must catch it, and prints the table and the score; it exits non-zero if any mutant survived or errored.
# MUTANTS=id1,id2 runs those only.
mutation: $(VENV)/.installed
	$(PY) tools/mutation/run.py $(if $(MUTANTS),--only $(MUTANTS))

clean:
	rm -rf $(VENV) $(NVFLARE_VENV) build fastagg/*.so *.egg-info
