#!/usr/bin/env bash
# The GPU check, as one run on a lent GPU machine (repo root; its stack: torch, triton, pybind11, pytest,
# pytest-benchmark preinstalled, no network):
#     bash bench/device_check.sh
# Builds fastagg, runs the Triton kernels on the GPU against the float64 reference (tests/test_on_device.py),
# then times them against a device-to-device copy and torch (bench/gpu_round.py). Output also goes to
# $OUT/device_check.txt when OUT is set. Paste the numbers, with the card's name, into bench/RESULTS.md.
set -euo pipefail
log="${OUT:-/tmp}/device_check.txt"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  pip install -q --no-build-isolation --no-deps -e .
  python -m pytest -q tests/test_on_device.py
  python bench/gpu_round.py --params 100000000
} 2>&1 | tee "$log"
