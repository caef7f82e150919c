#!/usr/bin/env bash
# The GPU check, as one run on a lent GPU machine (repo root; its own stack: torch, triton, pytest, pytest-xdist,
# pytest-benchmark preinstalled, no network):
#     bash bench/device_check.sh [gpu_bench sections, default all]
# 1. the Triton kernels on the GPU against the float64 reference (tests/test_on_device*.py: every kernel family,
#    fp32/bf16/fp16/fp64, list/[M, d]/per-layer input, M 1..1000, one 2^31+5-element row, a CUDA graph replay,
#    every server optimizer with group= on one NCCL rank (issue 26), HostFeeder's chunked pinned pipeline with 1 and
#    4 feeding threads, queued adds folded in one sweep, the grouped (L2) client schedule, the robust passes);
# 2. bench/gpu_bench.py: every kernel against a device-to-device copy timed in the same run, and against torch
#    ("robust": the coordinate-select and Gram passes against torch.median / sort / X @ X.T; "feed": HostFeeder per client against the bare pinned host-to-device copy; "queue": k queued adds in one
#    sweep against the copy; "sim": the vmapped convolution's alternatives and CUDA-graphed local steps).
# fastagg is imported from the checkout (PYTHONPATH), its C++ module built in place first (BUILD=0 skips it: the
# one test that moves a model from the CPU to the card then fails with an ImportError that says so). Everything lands in $OUT:
# device_check.txt (the whole log), pytest.txt, gpu_bench.md / .json (the tables for bench/RESULTS.md).
# TEST_FILTER (a pytest -k expression) reruns part of the tests after a fix. FASTAGG_TORCHFT_QUANT=path/to/torchft's
# quantization.py (extracted from the torchft 0.2.0 wheel; torchft is not on the card) adds its fp8 kernels to the
# compress section. Then torch.profiler's table of a round in every compressed format (profile_compressed.txt;
# PROFILE_LIMIT=0 skips it) and Nsight Compute's L2 hit rate of the client step (ncu_client.txt; NCU_LIMIT=0 skips it).
set -uo pipefail
OUT="${OUT:-/tmp/fastagg-device}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# the sections most likely to hang or fail last (the grouped client schedule spins on counters); one section's
# failure is recorded and the others run (gpu_bench.py), and the tables are written after every section
SECTIONS="${1:-copy,round,compress,robust,dp,queue,feed,pageable,server,sim,client}"
TEST_LIMIT="${TEST_LIMIT:-220}" BENCH_LIMIT="${BENCH_LIMIT:-240}"  # seconds
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
  python3 -c "import torch, triton; print('python', __import__('sys').version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
  # the C++ module too (in place): tests that hand a model from the CPU to the card compare the C++ step with
  # the Triton one; BUILD=0 skips it (those tests then fail with an ImportError that says so)
  if [ "${BUILD:-1}" = 1 ]; then
    start=$(date +%s)
    timeout "${BUILD_LIMIT:-240}" python3 -m pip install -q --no-build-isolation --no-deps -e . \
        > "$OUT/build.txt" 2>&1 || echo "== the C++ build failed: $OUT/build.txt"
    echo "== C++ build: $(( $(date +%s) - start )) s"
  fi
  start=$(date +%s)
  # correctness first; a kernel that hangs is killed with its worker (thread timeout) and reported
  # one torch thread per worker: the float64 references run on the host, 14 workers x 16 threads thrashed the 16
  # cores (the first run of the robust and DP tests timed out by the dozen); -v names each test as it ends, so a
  # run stopped by TEST_LIMIT still says what passed
  OMP_NUM_THREADS=1 timeout "$TEST_LIMIT" python3 -m pytest -v -p no:cacheprovider tests/test_on_device*.py \
      "tests/test_readme.py::test_blocks_run_elsewhere_compile_here" -n 14 --timeout 150 \
      --timeout-method=thread -ra --durations=15 ${TEST_FILTER:+-k "$TEST_FILTER"} 2>&1 | tee "$OUT/pytest.txt"
  echo "== pytest: $(( $(date +%s) - start )) s"
  start=$(date +%s)
  timeout "$BENCH_LIMIT" python3 bench/gpu_bench.py --out "$OUT" --sections "$SECTIONS"
  echo "== gpu_bench: $(( $(date +%s) - start )) s"
  # where a compressed round's time goes (run 4: 0.03-0.08 of copy on its bytes, mostly outside the fold kernel)
  if [ "${PROFILE_LIMIT:-90}" -gt 0 ]; then
    timeout "${PROFILE_LIMIT:-90}" python3 bench/profile_compressed_round.py all > "$OUT/profile_compressed.txt" 2>&1
  fi
  # the client step's L2 hit rate and DRAM bytes per schedule (issue 26's lead for FedSPS); NCU_LIMIT=0 skips it
  if [ "${NCU_LIMIT:-150}" -gt 0 ] && command -v ncu >/dev/null; then
    start=$(date +%s)
    timeout "${NCU_LIMIT:-150}" ncu --metrics \
        lts__t_sector_hit_rate.pct,dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
        -k 'regex:_grouped_kernel|_chunk_' python3 bench/ncu_client_step.py 2>&1 | tee "$OUT/ncu_client.txt"
    echo "== ncu: $(( $(date +%s) - start )) s"
  fi
} 2>&1 | tee "$OUT/device_check.txt"
