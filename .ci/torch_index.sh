#!/usr/bin/env bash
# The torch install as a CPU-only user with only the public package index meets it (pip --isolated: this machine's
# pip settings -- its local wheel store and constraints -- are ignored; nothing is installed, pip only resolves):
#  1. the public index's plain `torch==2.13.0` on Linux x86-64 is the CUDA build (nvidia-* / cuda-* packages): the
#     reason the Makefile asks for the CPU build, checked so that the note cannot go stale;
#  2. the Makefile's own request ($TORCH from PyTorch's CPU index $TORCH_INDEX) never resolves to a CUDA build: it
#     resolves to a build without nvidia-* / cuda-* packages, or, where that index cannot be reached, fails loudly.
# Usage: PY=.venv/bin/python TORCH=... TORCH_INDEX=... bash .ci/torch_index.sh   (run by .ci/package.sh)
set -euo pipefail
PY=${PY:-.venv/bin/python}
TORCH=${TORCH:-torch==2.13.0+cpu}
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cuda_packages() {  # the nvidia-* / cuda-* names in a pip --report
    "$PY" -c 'import json, sys
names = [i["metadata"]["name"].lower() for i in json.load(open(sys.argv[1]))["install"]]
print(" ".join(n for n in names if n.startswith(("nvidia-", "cuda-"))))' "$1"
}

if [ "$(uname -sm)" = "Linux x86_64" ]; then
    "$PY" -m pip --isolated install --dry-run --ignore-installed --quiet --report "$work/plain.json" torch==2.13.0
    plain=$(cuda_packages "$work/plain.json")
    [ -n "$plain" ] || { echo "the public index's torch==2.13.0 no longer pulls CUDA packages: update the Makefile's note"; exit 1; }
    echo "public index, plain torch==2.13.0: $(wc -w <<<"$plain") CUDA packages ($plain)"
fi

if "$PY" -m pip --isolated install --dry-run --ignore-installed --quiet --retries 1 --report "$work/ours.json" \
        "$TORCH" ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} >"$work/ours.log" 2>&1; then
    ours=$(cuda_packages "$work/ours.json")
    [ -z "$ours" ] || { echo "the Makefile's $TORCH resolves to CUDA packages: $ours"; exit 1; }
    echo "public index + ${TORCH_INDEX:-no extra index}: $TORCH resolves with no CUDA package"
else
    grep -q "No matching distribution found for torch\|ResolutionImpossible\|Could not find a version" "$work/ours.log" \
        || { cat "$work/ours.log"; echo "resolving $TORCH failed for another reason"; exit 1; }
    echo "public index + ${TORCH_INDEX:-no extra index} unreachable here: $TORCH is refused (no CUDA fallback)"
fi
