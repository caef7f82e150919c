#!/usr/bin/env bash
# The package as a user gets it: build the sdist, build a wheel from that sdist alone (pip unpacks it into a
# directory of its own: nothing of this checkout is visible), install the wheel into a fresh venv (the CPU build of
# torch first), then import fastagg from another directory and run one fused step on the compiled C++ backend.
# Usage: PY=.venv/bin/python bash .ci/package.sh   (`make test-package`; CI runs it; KEEP_WHEEL_DIR=dir keeps the
# wheel there)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(realpath -s "${PY:-.venv/bin/python}")  # absolute, the venv link kept
TORCH=${TORCH:-torch==2.13.0+cpu}                             # the Makefile's defaults (make test-package passes them)
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== sdist"
"$PY" -m build --sdist --outdir "$work/dist" .
sdist=$(ls "$work"/dist/fastagg-*.tar.gz)
listing=$(tar tzf "$sdist")
for f in csrc/kernels.h csrc/views.h csrc/segments.h csrc/convert.h csrc/bindings.cpp csrc/robust.cpp LICENSE docs/ALGORITHMS.md; do
    grep -q "/$f\$" <<<"$listing" || { echo "the sdist lacks $f"; exit 1; }
done

echo "== wheel from the sdist"
(cd "$work" && "$PY" -m pip wheel --no-deps --wheel-dir "$work/wheels" "$sdist")

if [ -n "${KEEP_WHEEL_DIR:-}" ]; then  # CI installs this wheel into NVIDIA FLARE's env instead of building again
    mkdir -p "$KEEP_WHEEL_DIR"
    rm -f "$KEEP_WHEEL_DIR"/fastagg-*.whl
    cp "$work"/wheels/fastagg-*.whl "$KEEP_WHEEL_DIR"/
fi

echo "== fresh venv: $TORCH, then the wheel"
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --upgrade pip
"$work/venv/bin/python" -m pip install --no-deps "$TORCH" ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"}
"$work/venv/bin/python" -m pip install "$TORCH"  # its dependencies, from the default index
"$work/venv/bin/python" -m pip install "$work"/wheels/fastagg-*.whl

echo "== import from another directory, one fused step on the C++ backend"
cd "$work"
"$work/venv/bin/python" - <<'PY'
import os, sys, torch, fastagg

assert os.path.realpath(fastagg.__file__).startswith(os.path.realpath(sys.prefix)), fastagg.__file__
deltas = torch.randn(8, 100_000, generator=torch.Generator().manual_seed(0))
w = torch.zeros(100_000)
res = fastagg.fedexp_step(deltas, eps=1e-3, params=w, backend="cpu")
ref = fastagg.fedexp_step(deltas, eps=1e-3, backend="reference")
err = float((res.update - ref.update).norm() / ref.update.norm())  # float32 against the plain-torch oracle
assert err < 1e-6 and torch.equal(w, res.update), (err, float(res.eta), float(ref.eta))
opt = fastagg.server.FedAdam(torch.zeros(100_000), backend="cpu")
opt.step(deltas)
print(f"installed fastagg {fastagg.__version__} from {os.path.dirname(fastagg.__file__)}: eta {float(res.eta):.4f}")
print(fastagg.env_report().splitlines()[1])
PY
cd - >/dev/null
echo "== what the public index alone gives for torch (this machine's pip settings ignored)"
PY="$PY" TORCH="$TORCH" TORCH_INDEX="$TORCH_INDEX" bash .ci/torch_index.sh
echo "package check passed"
