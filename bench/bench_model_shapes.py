"""Real model shapes (issue 42): a server round on state_dicts of 100-400 entries, against the bytes it must read.

The shapes of ResNet-18 (122 entries), ResNet-50 (320), BERT-base (~200) and GPT-2 small (~150), built from their
layer lists (no download), full width and at 1/8 width (channels / hidden size divided by 8: the small many-layer
models of cross-device FL). 16 clients, each ``global + noise`` as a state_dict (BatchNorm statistics and counters
included for the ResNets). Every call is timed interleaved with the others, one round each in turn (medians):

- ``read``: a plain read of the same bytes (the clients' parameters as one contiguous buffer, ``sum``; above 1 GiB,
  one client-sized buffer read M times, so the benchmark does not hold the clients twice);
- ``torch _foreach``: the weighted mean over the entries with ``torch._foreach_add_`` / ``_foreach_mul_``;
- ``Flower aggregate``: Flower's numpy ``aggregate`` (``flwr.server.strategy.aggregate``) on the same arrays;
- ``fedavg_step``: ``fastagg.fedavg_step(models=client state_dicts, params=...)`` (the functional API, each update
  ``model_i - params`` formed inside the pass);
- ``FLARE ...``: NVIDIA FLARE's ``WeightedAggregationHelper`` and ``fastagg.nvflare.FastaggAggregator`` on the
  clients' state_dicts as numpy arrays, when nvflare is importable (:func:`flare_calls`; run it with
  ``.venv-nvflare/bin/python``);
- ``FedAvg / FedAdam / FedExP .step``: ``fastagg.server.*(global state_dict).step(client state_dicts, base=...)``,
  full client models measured from the broadcast point; ``Accumulator + FedAvg.step``: the same clients added to an
  Accumulator one by one (``base=`` the model), then one step;

It prints each call's time, its ratio to the read, and the per-call overhead (time minus the read: at 1/8 width
that is almost all Python per entry). Then Flower's message-API FedAvg / FedAdam strategies and fastagg.flower's on
the same reply Messages (``configure_train`` + ``aggregate_train``; :func:`flower_calls`).

    python bench/bench_model_shapes.py                       # every model, full and 1/8 width, 1 and 2 threads
    python bench/bench_model_shapes.py --models resnet18 --widths 8 --threads 1 --rounds 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

import fastagg
from fastagg import server


def _bn(prefix: str, c: int) -> list:
    return [(f"{prefix}.weight", (c,)), (f"{prefix}.bias", (c,)), (f"{prefix}.running_mean", (c,)),
            (f"{prefix}.running_var", (c,)), (f"{prefix}.num_batches_tracked", ())]


def resnet(blocks: list, bottleneck: bool, w: int) -> list:
    """torchvision's ResNet state_dict entries (names, shapes) at width 64 / w."""
    c0 = 64 // w
    out = [("conv1.weight", (c0, 3, 7, 7))] + _bn("bn1", c0)
    cin = c0
    for li, n in enumerate(blocks):
        width = (64 << li) // w
        cout = width * (4 if bottleneck else 1)
        for b in range(n):
            p = f"layer{li + 1}.{b}"
            if bottleneck:
                out += [(f"{p}.conv1.weight", (width, cin, 1, 1))] + _bn(f"{p}.bn1", width)
                out += [(f"{p}.conv2.weight", (width, width, 3, 3))] + _bn(f"{p}.bn2", width)
                out += [(f"{p}.conv3.weight", (cout, width, 1, 1))] + _bn(f"{p}.bn3", cout)
            else:
                out += [(f"{p}.conv1.weight", (width, cin, 3, 3))] + _bn(f"{p}.bn1", width)
                out += [(f"{p}.conv2.weight", (width, width, 3, 3))] + _bn(f"{p}.bn2", width)
            if b == 0 and (cin != cout or li > 0):
                out += [(f"{p}.downsample.0.weight", (cout, cin, 1, 1))] + _bn(f"{p}.downsample.1", cout)
            cin = cout
    return out + [("fc.weight", (1000, cin)), ("fc.bias", (1000,))]


def bert_base(w: int) -> list:
    """Hugging Face BertModel entries at hidden 768 / w (vocabulary 30522, 12 layers)."""
    h, f = 768 // w, 3072 // w
    out = [("embeddings.word_embeddings.weight", (30522, h)), ("embeddings.position_embeddings.weight", (512, h)),
           ("embeddings.token_type_embeddings.weight", (2, h)), ("embeddings.LayerNorm.weight", (h,)),
           ("embeddings.LayerNorm.bias", (h,))]
    for i in range(12):
        p = f"encoder.layer.{i}"
        for m in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            out += [(f"{p}.{m}.weight", (h, h)), (f"{p}.{m}.bias", (h,))]
        out += [(f"{p}.attention.output.LayerNorm.weight", (h,)), (f"{p}.attention.output.LayerNorm.bias", (h,)),
                (f"{p}.intermediate.dense.weight", (f, h)), (f"{p}.intermediate.dense.bias", (f,)),
                (f"{p}.output.dense.weight", (h, f)), (f"{p}.output.dense.bias", (h,)),
                (f"{p}.output.LayerNorm.weight", (h,)), (f"{p}.output.LayerNorm.bias", (h,))]
    return out + [("pooler.dense.weight", (h, h)), ("pooler.dense.bias", (h,))]


def gpt2_small(w: int) -> list:
    """Hugging Face GPT2Model entries at hidden 768 / w (vocabulary 50257, 1024 positions, 12 blocks)."""
    h = 768 // w
    out = [("wte.weight", (50257, h)), ("wpe.weight", (1024, h))]
    for i in range(12):
        p = f"h.{i}"
        out += [(f"{p}.ln_1.weight", (h,)), (f"{p}.ln_1.bias", (h,)), (f"{p}.attn.c_attn.weight", (h, 3 * h)),
                (f"{p}.attn.c_attn.bias", (3 * h,)), (f"{p}.attn.c_proj.weight", (h, h)), (f"{p}.attn.c_proj.bias", (h,)),
                (f"{p}.ln_2.weight", (h,)), (f"{p}.ln_2.bias", (h,)), (f"{p}.mlp.c_fc.weight", (h, 4 * h)),
                (f"{p}.mlp.c_fc.bias", (4 * h,)), (f"{p}.mlp.c_proj.weight", (4 * h, h)), (f"{p}.mlp.c_proj.bias", (h,))]
    return out + [("ln_f.weight", (h,)), ("ln_f.bias", (h,))]


MODELS = {"resnet18": lambda w: resnet([2, 2, 2, 2], False, w), "resnet50": lambda w: resnet([3, 4, 6, 3], True, w),
          "bert-base": bert_base, "gpt2-small": gpt2_small}


def state_dicts(entries: list, clients: int, seed: int = 0) -> tuple:
    """The global state_dict and ``clients`` client state_dicts (``global + 0.01 noise`` on floating entries; the
    BatchNorm counters one step further)."""
    g = torch.Generator().manual_seed(seed)
    glob = {n: (torch.zeros(s, dtype=torch.int64) if n.endswith("num_batches_tracked") else torch.randn(s, generator=g))
            for n, s in entries}
    for n, t in glob.items():  # variances are positive (a robust rule refuses a negative running_var as an attack)
        if n.endswith("running_var"):
            t.abs_().add_(0.5)
    out = []
    for _ in range(clients):
        out.append({n: t + 1 if not t.is_floating_point() else t + 0.01 * torch.randn(t.shape, generator=g)
                    for n, t in glob.items()})
    return glob, out


def calls(glob: dict, clients: list) -> dict:
    """name -> a zero-argument call that runs one round (each on its own copy of the global model; Flower's
    ``aggregate`` where flwr is importable: not in ``.venv-nvflare``)."""
    try:
        from flwr.server.strategy.aggregate import aggregate
    except ImportError:
        aggregate = None

    m = len(clients)
    weights = [float(100 + 7 * i) for i in range(m)]
    floats = [n for n, t in glob.items() if t.is_floating_point()]
    numel = sum(glob[n].numel() for n in floats)
    whole = m * numel * 4 <= 1 << 30  # the clients' parameter bytes, contiguous: what a plain read costs
    flat = torch.randn(m * numel if whole else numel)
    params = {n: t.clone() for n, t in glob.items()}
    nd = [[c[n].numpy() for n in floats] for c in clients]
    lists = [[c[n] for n in floats] for c in clients]
    coefs = [w / sum(weights) for w in weights]

    def foreach():
        acc = [torch.zeros_like(glob[n]) for n in floats]
        for x, c in zip(lists, coefs):
            torch._foreach_add_(acc, x, alpha=c)
        return acc

    def read():
        return flat.sum() if whole else [flat.sum() for _ in range(m)]

    out = {"read": read, "torch _foreach": foreach}
    if aggregate is not None:
        out["Flower aggregate"] = lambda: aggregate(list(zip(nd, [int(w) for w in weights])))
    out |= {"fedavg_step": lambda: fastagg.fedavg_step(models=clients, weights=weights, params=params)}
    for name, cls, kw in (("FedAvg", server.FedAvg, {}), ("FedAdam", server.FedAdam, {}),
                          ("FedExP", server.FedExP, {"eps": 1e-3})):
        model = {n: t.clone() for n, t in glob.items()}
        opt = cls(model, **kw)
        base = {n: t.clone() for n, t in glob.items()}
        out[f"{name}.step"] = (lambda o=opt, b=base: o.step(clients, weights, base=b))
    model = {n: t.clone() for n, t in glob.items()}
    base = {n: t.clone() for n, t in glob.items()}
    opt = server.FedAvg(model)

    def accumulated(opt=opt, model=model, base=base):
        acc = fastagg.Accumulator(like=model)
        for c, w in zip(clients, weights):
            acc.add(c, weight=w, base=base)
        opt.step(acc)

    out["Accumulator + FedAvg.step"] = accumulated
    return out


def rule_calls(glob: dict, clients: list) -> dict:
    """FedAvg with a robust rule (Median, Krum) and server-side DP clipping on the same clients (``--rules``)."""
    from fastagg import privacy, robust

    m = len(clients)
    out = {}
    for name, agg in (("Median", robust.Median()), ("Krum", robust.Krum(max(1, (m - 3) // 4))),
                      ("server-side DP", privacy.ServerSideFixedClipping(0.1, 1.0, m, seed=1))):
        model = {n: t.clone() for n, t in glob.items()}
        opt = server.FedAvg(model, aggregate=agg)
        base = {n: t.clone() for n, t in glob.items()}
        out[f"FedAvg({name}).step"] = (lambda o=opt, b=base: o.step(clients, base=b))
    return out


def flower_calls(glob: dict, clients: list) -> dict:
    """Flower's message-API FedAvg / FedAdam (flwr.serverapp.strategy) and fastagg.flower's, each timed as
    ``configure_train`` + ``aggregate_train`` over the same reply Messages: one ArrayRecord a client holding its
    state_dict's entries as numpy arrays (the BatchNorm statistics and counters included, as a Flower client sends
    ``model.state_dict()``), weighted by ``num-examples``."""
    import logging

    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.serverapp import strategy as flower_strategy
    from flwr.supercore.task_identity import TaskIdentity

    from fastagg import flower as fastagg_flower

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # Messages outside a run (flwr 1.42)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    m = len(clients)

    class Grid:
        def get_node_ids(self):
            return list(range(1, m + 1))

    def record(sd):
        return ArrayRecord({k: Array(v.numpy()) for k, v in sd.items()})

    out = {}
    for label, module in (("Flower", flower_strategy), ("fastagg.flower", fastagg_flower)):
        for rule in ("FedAvg", "FedAdam"):
            strat = getattr(module, rule)(min_available_nodes=1)
            state = {"arrays": record(glob), "round": 0}
            msgs = sorted(strat.configure_train(1, state["arrays"], ConfigRecord(), Grid()),
                          key=lambda msg: msg.metadata.dst_node_id)
            replies = [Message(content=RecordDict({"arrays": record(c), "metrics": MetricRecord(
                {"num-examples": 100 + 7 * i})}), reply_to=msg) for i, (c, msg) in enumerate(zip(clients, msgs))]

            def one_round(strat=strat, state=state, replies=replies):
                state["round"] += 1
                strat.configure_train(state["round"], state["arrays"], ConfigRecord(), Grid())
                arrays, _ = strat.aggregate_train(state["round"], replies)
                state["arrays"] = arrays

            out[f"{label} {rule}"] = one_round
    return out


def flare_calls(glob: dict, clients: list) -> dict:
    """NVIDIA FLARE (when nvflare is importable: ``.venv-nvflare``, ``make test-nvflare``'s environment): a round as
    FLARE's FedAvg runs it, each client's result a dict of numpy arrays (its state_dict) weighted by
    ``NUM_STEPS_CURRENT_ROUND``: FLARE's ``WeightedAggregationHelper`` (``add`` per result, ``get_result``; a new one
    a round, as FLARE builds) against ``fastagg.nvflare.FastaggAggregator(rule="fedavg")`` (``set_model``,
    ``accept_model`` per result, ``aggregate_model``; one for the run)."""
    try:
        from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
        from nvflare.app_common.aggregators.weighted_aggregation_helper import WeightedAggregationHelper
    except ImportError:
        return {}
    from fastagg.nvflare import FastaggAggregator

    g = {k: v.numpy() for k, v in glob.items()}
    results = [{k: v.numpy() for k, v in c.items()} for c in clients]
    steps = [float(100 + 7 * i) for i in range(len(clients))]
    agg = FastaggAggregator(rule="fedavg")
    state = {"round": 0}

    def helper():
        h = WeightedAggregationHelper()
        for i, (r, w) in enumerate(zip(results, steps)):
            h.add(data=r, weight=w, contributor_name=f"site-{i}", contribution_round=0)
        return h.get_result()

    def fastagg_round():
        state["round"] += 1
        agg.reset_stats()
        agg.set_model(FLModel(params_type=ParamsType.FULL, params=g, current_round=state["round"]))
        for i, (r, w) in enumerate(zip(results, steps)):
            agg.accept_model(FLModel(params_type=ParamsType.FULL, params=r, current_round=state["round"],
                                     meta={"client_name": f"site-{i}", "NUM_STEPS_CURRENT_ROUND": w}))
        return agg.aggregate_model()

    return {"FLARE WeightedAggregationHelper": helper, "FLARE FastaggAggregator": fastagg_round}


def interleaved(fns: dict, rounds: int) -> dict:
    times = {k: [] for k in fns}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--widths", default="1,8", help="width divisors (1: full size, 8: 1/8 width; default: 1,8)")
    ap.add_argument("--threads", default="1,2", help="torch / OpenMP thread counts to run (default: 1,2)")
    ap.add_argument("--clients", type=int, default=16, help="clients per round (default: 16)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per call, medians (default: 7)")
    ap.add_argument("--rules", action="store_true",
                    help="also FedAvg with Median, Krum and server-side DP clipping (robust and DP rounds)")
    ap.add_argument("--no-flower-strategies", action="store_true",
                    help="leave out the message-API strategies (Flower's and fastagg.flower's FedAvg / FedAdam)")
    a = ap.parse_args()
    print(f"torch {torch.__version__}, numpy {np.__version__}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
          f"{a.clients} clients, medians of {a.rounds} interleaved rounds")
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        for name in a.models.split(","):
            for w in (int(x) for x in a.widths.split(",")):
                entries = MODELS[name](w)
                glob, clients = state_dicts(entries, a.clients)
                numel = sum(t.numel() for t in glob.values() if t.is_floating_point())
                fns = calls(glob, clients)
                if not a.no_flower_strategies:
                    fns.update(flower_calls(glob, clients))
                if a.rules:
                    fns.update(rule_calls(glob, clients))
                fns.update(flare_calls(glob, clients))
                med = interleaved(fns, a.rounds)
                read = med["read"]
                gbs = a.clients * numel * 4 / read / 1e9
                print(f"\n{name} at 1/{w} width: {len(entries)} entries, {numel / 1e6:.2f}M parameters, {threads} "
                      f"thread(s); read {read * 1e3:.2f} ms ({gbs:.1f} GB/s)")
                for k, v in med.items():
                    if k != "read":
                        print(f"  {k:18s} {v * 1e3:9.2f} ms  {v / read:7.1f}x read  overhead {(v - read) * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
