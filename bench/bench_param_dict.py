"""The functional API's ``params=`` state_dict, parsed every call: the whole-dict path (``flat.param_dict_entries``)
against the general entry-by-entry path (forced by patching the whole-dict one out), interleaved in one run.

    python bench/bench_param_dict.py [--rounds 40] [--models resnet18,bert-base] [--width 8]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_model_shapes as shapes  # noqa: E402

import fastagg  # noqa: E402
from fastagg import flat, rows  # noqa: E402

ENTRIES = {"resnet18": lambda w: shapes.resnet([2, 2, 2, 2], False, w), "bert-base": shapes.bert_base,
           "gpt2-small": shapes.gpt2_small}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--models", default="resnet18,bert-base")
    ap.add_argument("--width", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    real = flat.param_dict_entries
    print(f"torch {torch.__version__}, load {os.getloadavg()[0]:.1f}; 16 clients, 1 thread, medians of {args.rounds}")
    for model in args.models.split(","):
        glob, clients = shapes.state_dicts(ENTRIES[model](args.width), 16)
        params = {k: v.clone() for k, v in glob.items()}

        def whole():
            rows.param_dict_entries = real
            fastagg.fedavg_step(models=clients, params=params)

        def general():
            rows.param_dict_entries = lambda *a, **k: None
            fastagg.fedavg_step(models=clients, params=params)

        times = {"general": [], "whole": []}
        for _ in range(3):
            general(), whole()
        for _ in range(args.rounds):
            for name, fn in (("general", general), ("whole", whole)):
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        rows.param_dict_entries = real
        g, w = (statistics.median(times[k]) * 1e3 for k in ("general", "whole"))
        print(f"{model} at 1/{args.width}: fedavg_step, params parsed entry by entry {g:.2f} ms, "
              f"as a whole dict {w:.2f} ms ({g / w:.2f}x)")


if __name__ == "__main__":
    main()
