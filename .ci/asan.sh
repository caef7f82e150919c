#!/usr/bin/env bash
# The C++ kernels under AddressSanitizer + UndefinedBehaviorSanitizer: build fastagg._C_asan, prove the sanitizer
# stops an out-of-bounds write here (a canary), then run the C++-backend tests against the sanitized module.
# Any sanitizer report aborts the test process, which fails this script. Called by `make test-asan`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -O1"
PRELOAD="$(g++ -print-file-name=libasan.so):$(g++ -print-file-name=libubsan.so)"
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:allocator_may_return_null=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"

FASTAGG_SANITIZE=1 "$PY" setup.py -q build_ext --inplace 2>&1 | grep -v -i "warning" || true
test -n "$(ls fastagg/_C_asan*.so)"

canary="$(mktemp -d)/canary"
g++ $FLAGS .ci/asan_canary.cpp -o "$canary"
if LD_PRELOAD="$PRELOAD" "$canary" >/dev/null 2>"$canary.log"; then
  echo "asan: the canary's out-of-bounds write was NOT caught: the sanitizer is not active" >&2
  exit 1
fi
grep -q "heap-buffer-overflow" "$canary.log" || { cat "$canary.log" >&2; exit 1; }
echo "asan: canary caught (heap-buffer-overflow), sanitizer active"

# the tests below must run the sanitized module: fail here if it does not load (cpu_backends() would drop "cpu")
LD_PRELOAD="$PRELOAD" FASTAGG_CPU_ISA=asan "$PY" -c "
from fastagg.backends import cpu, available
assert cpu.IMPORT_ERROR is None and cpu._C.__name__ == 'fastagg._C_asan', cpu.IMPORT_ERROR
assert 'cpu' in available('cpu')
print('asan: tests run', cpu._C.__name__)"

LD_PRELOAD="$PRELOAD" FASTAGG_CPU_ISA=asan TRITON_INTERPRET=1 FASTAGG_FUZZ_EXAMPLES="${FASTAGG_FUZZ_EXAMPLES:-40}" \
  "$PY" -m pytest -q -p no:cacheprovider --capture=sys -k "cpu and not isa" \
  tests/test_round.py tests/test_server.py tests/test_client.py tests/test_stream.py tests/test_safety.py \
  tests/test_errors.py tests/test_fuzz.py tests/test_properties.py tests/test_stream_concurrency.py \
  tests/test_robust.py tests/test_robust_kernels.py tests/test_privacy.py tests/test_privacy_noise.py \
  tests/test_compress.py tests/test_compress_formats.py tests/test_compress_clients.py

# the row tables fastagg._tensor_facts makes (csrc/row_table.h), read by the sanitized binding
LD_PRELOAD="$PRELOAD" FASTAGG_CPU_ISA=asan "$PY" -m pytest -q -p no:cacheprovider --capture=sys tests/test_tensor_facts.py
