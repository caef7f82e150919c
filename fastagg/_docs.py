"""Argument descriptions shared by the public docstrings (written once, substituted with ``share_docs``)."""
from __future__ import annotations

import re

ARGS = {
    "deltas": """deltas: the M participating clients' updates, ``delta_i = client model - global model`` (fastagg adds
        the server step: ``w <- w + step``). A ``[M, d]`` tensor (rows may be strided; the parameter dimension
        must have unit stride), a list of M flat tensors, a list of M per-layer lists or state_dicts, or numpy
        arrays of any of these (wrapped without copies). Nothing is copied or stacked; never modified.""",
    "models": """models: instead of ``deltas``, the clients' full models (what Flower and FedML ship), in any form
        ``deltas`` accepts; ``delta_i = models[i] - params`` is formed inside the kernels and never stored.
        Needs ``params`` (of the same dtype).""",
    "weights": """weights: per-client weights ``n_i`` such as example counts (list, numpy array or tensor of shape
        ``(M,)``, finite, >= 0, not all zero); normalized over the participants, ``p_i = n_i / sum_j n_j``.
        Default: ``p_i = 1/M``. Weights on a CUDA device are read to the host once to be validated, except with
        ``on_nonfinite="skip"``: then they are checked on the device and bad weights skip the round.""",
    "params": """params: the global model, updated in place: a flat tensor or array, a per-layer list, a
        state_dict or an ``nn.Module``. Parameters are stepped; buffers (BatchNorm running statistics) become the
        clients' weighted average. Any floating dtype; the mean and update are computed in float32 (float64 for
        float64 params, whatever the deltas' dtype) and rounded once to ``params``' dtype. Untouched when the
        round is not finite; never written with Inf or NaN.""",
    "eps": """eps: FedExP's denominator term in squared-update-norm units (>= 0; depends on d, the local lr and
        steps). Porting from the FedExP code: the paper's published values (1e-3 CIFAR/CINIC, 1e-1 EMNIST) are in
        the official code's convention, ``M * eps``; with the default ``eps_mode="paper"`` the same number gives a
        larger eta (about 15% larger in the paper's setups). Pass ``eps_mode="official"`` to get the official
        code's eta.""",
    "eps_mode": """eps_mode: ``"paper"`` (default): denominator ``2 (||mean||^2 + eps)``; ``"official"``: the
        official code's ``2 (||mean||^2 + M * eps)``.""",
    "on_nonfinite": """on_nonfinite: ``"raise"`` (default): a ``ValueError`` naming the clients with NaN/Inf, and
        nothing is updated; on CUDA this reads one flag to the host, the call's only sync. ``"skip"``: no host
        read; nothing is updated and ``result.finite`` / ``result.nonfinite`` say what happened.""",
    "mean_out": """mean_out: optional preallocated flat buffer for the mean (float32; float64 for float64 data; d
        elements on the inputs' device). A fresh 40 MB buffer costs ~17 ms of page faults on a CPU: reuse one.""",
    "backend": """backend: ``"auto"`` (CUDA -> Triton, CPU -> compiled C++, other devices -> reference),
        ``"reference"``, ``"cpu"`` or ``"triton"``. An explicit backend that cannot run raises and lists what can.""",
}

NUMERICS = """Numerics: per-element math in float32 (float64 for float64 params, else for float64 deltas); other
    dtypes are converted on load. ``mean`` and ``update`` are in that dtype; squares, norms, ``eta`` and every
    reduction feeding them are float64. Every scalar stays on the input's device as a 0-d tensor (no host sync, except the one
    ``on_nonfinite="raise"`` documents). Reductions run in a fixed order: on the CPU the same input gives
    bit-identical results run after run for a given thread count (the C++ backend: for any thread count).
    Tensors in, tensors out on the same device; numpy in, numpy out."""


def _indented(text: str, indent: str, hanging: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines()]
    return lines[0] + "".join("\n" + indent + hanging + ln for ln in lines[1:])


def share_docs(fn):
    """Fill ``{deltas}``, ``{weights}``, ... and ``{numerics}`` in ``fn.__doc__``, keeping its indentation."""
    doc = fn.__doc__
    for key, text in [*ARGS.items(), ("numerics", NUMERICS)]:
        m = re.search(r"^([ \t]*)\{" + key + r"\}", doc, flags=re.M)
        if m:
            hanging = "    " if key != "numerics" else ""
            doc = doc.replace("{" + key + "}", _indented(text, m.group(1), hanging))
    fn.__doc__ = doc
    return fn
