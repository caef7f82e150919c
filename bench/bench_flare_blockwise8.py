"""FLARE BLOCKWISE8 results aggregated: FLARE's own path against fastagg folding them where they lie. Run in the
NVIDIA FLARE environment (``make test-nvflare`` builds .venv-nvflare with nvflare 2.9.0 and bitsandbytes 0.50.2):

    .venv-nvflare/bin/python bench/bench_flare_blockwise8.py

M = 16 sites send their update (``DIFF``) quantized by FLARE's ``ModelQuantizer("blockwise8")`` (bitsandbytes'
dynamic 8-bit code, an absmax per 4096 elements of each tensor); the model has d = 10^7 float32 parameters
(FASTAGG_BENCH_D) in 10 tensors. Timed per round, interleaved in a fresh random order, medians of 7:

- ``flare``: what a FLARE server does with them: ``ModelDequantizer`` on every result (bitsandbytes'
  ``dequantize_blockwise`` per tensor; FLARE calls ``.cuda()`` first, a no-op here: this machine has no GPU, so
  bitsandbytes' CPU kernels run, as on a FLARE server without one), then FLARE's ``WeightedAggregationHelper``
  (the weighted sum in torch per tensor, then the division) - the mean update - and the new global model as FLARE
  makes it from a WEIGHT_DIFF (``FullModelShareableGenerator.shareable_to_learnable``: ``weights[k] + diff[k]``
  per tensor), so both sides end at the new model;
- ``fastagg``: ``FastaggAggregator("fedavg")``: ``accept_model`` of every quantized result (folded where it lies),
  then ``aggregate_model`` (the FedAvg step: the new model);
- ``read``: one plain read of the quantized bytes (the codes viewed as float32 and summed).

Each path's new model is kept until its next round's replaces it, as FLARE's controller keeps its global model (a
benchmark that dropped it at once let the allocator hand the same pages back: a pattern no server has, and one
that moved either path's time by the cost of touching 40 MB of fresh pages).
"""
from __future__ import annotations

import os

import numpy as np
import torch

from baselines import interleaved_medians

D = int(float(os.environ.get("FASTAGG_BENCH_D", "1e7")))
M, LAYERS = 16, 10


def main(rounds: int = 7) -> dict:
    # (imported here: pytest collects bench/ in the main environment, which has no FLARE)
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
    from nvflare.app_common.aggregators.weighted_aggregation_helper import WeightedAggregationHelper
    from nvflare.app_opt.pt.quantization.dequantizer import ModelDequantizer
    from nvflare.app_opt.pt.quantization.quantizer import ModelQuantizer

    from fastagg.nvflare import FastaggAggregator

    torch.Tensor.cuda = lambda self, *a, **k: self  # FLARE's filters move tensors to a GPU this machine lacks
    shapes = {f"layer{i}.weight": (D // LAYERS // 1000, 1000) for i in range(LAYERS)}
    rng = np.random.default_rng(0)
    sent = {k: np.zeros(s, dtype=np.float32) for k, s in shapes.items()}
    quantizer, dequantizer = ModelQuantizer("blockwise8"), ModelDequantizer()
    quantizer.log_info = dequantizer.log_info = lambda *a, **k: None
    results = []
    for i in range(M):
        update = {k: (0.01 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
        data, state, source = quantizer.quantization(update, None)
        results.append((data, {"processed_algorithm": "blockwise8", "quant_state": state,
                               "source_datatype": source, "quantized_flag": True, "client_name": f"site-{i}"}))
    codes = torch.cat([torch.as_tensor(v).reshape(-1) for d, _ in results for v in d.values()])
    raw = codes[: codes.numel() // 4 * 4].view(torch.float32)
    quantized_bytes = sum(v.nbytes for d, _ in results for v in d.values()) + \
        sum(s["absmax"].nbytes + s["code"].nbytes for _, m in results for s in m["quant_state"].values())
    agg = FastaggAggregator("fedavg")

    held: dict = {}  # each path's last new model (see the module docstring)

    def flare():
        helper = WeightedAggregationHelper()
        for i, (data, meta) in enumerate(results):
            dense = dequantizer.dequantization(params={k: np.asarray(v) for k, v in data.items()},
                                               quant_state=meta["quant_state"], quantization_type="blockwise8",
                                               source_datatype=meta["source_datatype"], fl_ctx=None)
            helper.add(dense, 1.0, f"site-{i}", 0)
        mean = helper.get_result()
        held["flare"] = {k: sent[k] + np.asarray(v) for k, v in mean.items()}  # as full_model_shareable_generator.py
        return held["flare"]

    def fastagg_round():
        agg.reset_stats()
        agg.set_model(FLModel(params_type=ParamsType.FULL, params=sent, current_round=0))
        for data, meta in results:
            assert agg.accept_model(FLModel(params_type=ParamsType.DIFF, params=data, meta=meta, current_round=0))
        held["fastagg"] = agg.aggregate_model()
        return held["fastagg"]

    want, got = flare(), fastagg_round()  # (also the warm-up) the same mean update, to float32 rounding
    for k in shapes:
        np.testing.assert_allclose(got.params[k], np.asarray(want[k]), rtol=1e-4, atol=1e-6)
    calls = {"flare": flare, "fastagg": fastagg_round, "read": raw.sum}
    med = interleaved_medians(calls, rounds, warmup=0)
    print(f"M = {M}, d = {D} in {LAYERS} tensors, blockwise8 (block 4096), torch {torch.__version__}, "
          f"{os.cpu_count()} cores, medians of {rounds}; quantized bytes {quantized_bytes / 1e6:.0f} MB")
    for k, t in med.items():
        print(f"  {k:8s} {t * 1e3:9.1f} ms   {quantized_bytes / t / 1e9:6.2f} GB/s of quantized bytes")
    print(f"  flare / fastagg {med['flare'] / med['fastagg']:.1f}x;  fastagg / read {med['fastagg'] / med['read']:.2f}x")
    return med


if __name__ == "__main__":
    main()
