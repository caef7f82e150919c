"""ServerApp: a fastagg.flower strategy (or Flower's own, to compare) run by Flower's start(); writes a summary."""
from __future__ import annotations

import json
import time

from flwr.app import Array, ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from .task import cfg, initial_linear, make_cnn

app = ServerApp()
LAST_SUMMARY: dict = {}  # filled in-process as well (run_simulation)


def make_strategy(name: str, config) -> object:
    """A strategy by run-config name: fastagg's (``fedexp``, ``fedadam``, ...) or Flower's own (``flower-...``)."""
    nodes = int(cfg(config, "min-nodes"))
    common = dict(min_available_nodes=nodes, min_train_nodes=nodes, min_evaluate_nodes=nodes,
                  fraction_evaluate=float(cfg(config, "fraction-evaluate")))
    if name.startswith("flower-"):
        from flwr.serverapp import strategy as fl

        return {"flower-fedavg": fl.FedAvg, "flower-fedadam": fl.FedAdam}[name](**common)
    from fastagg import flower as fa

    common["on_nonfinite"] = str(cfg(config, "on-nonfinite"))
    common["buffers"] = str(cfg(config, "buffers"))  # "optimizer": BatchNorm statistics stepped, as Flower does
    eps = float(cfg(config, "eps"))
    makers = {"fedexp": lambda: fa.FedExP(eps=eps, **common), "fedexpm": lambda: fa.FedExPM(eps=eps, **common),
              "fedacg": lambda: fa.FedACG(**common), "fedavg": lambda: fa.FedAvg(**common),
              "fedavgm": lambda: fa.FedAvgM(server_momentum=0.9, **common), "fedadam": lambda: fa.FedAdam(**common),
              "fedyogi": lambda: fa.FedYogi(**common), "fedadagrad": lambda: fa.FedAdagrad(**common),
              "fedams": lambda: fa.FedAMS(**common)}
    return makers[name]()


def initial_arrays(model: str) -> ArrayRecord:
    if model == "linear":
        return ArrayRecord({k: Array(v) for k, v in initial_linear().items()})
    return ArrayRecord(make_cnn().state_dict())


def run_fedbuff(grid: Grid, config, model: str) -> dict:
    """``strategy = "fedbuff"``: fastagg's asynchronous FedBuff (FedAvgM, a step every 2 replies, no rounds);
    ``num-server-rounds`` counts its server steps."""
    from fastagg.flower.asynchronous import FedBuff

    steps = int(cfg(config, "num-server-rounds"))
    result = FedBuff("fedavgm", optimizer_kwargs={"lr": 1.0, "momentum": 0.5}, buffer_size=2).start(
        grid, initial_arrays(model), num_steps=steps, timeout=600)
    final = {k: a.numpy() for k, a in result.arrays.items()}
    return {"strategy": "fedbuff", "model": model, "rounds": result.version,
            "train": {str(v): dict(m) for v, m in result.train_metrics.items()},
            "updates_per_node": {str(k): n for k, n in result.updates_per_node.items()},
            "staleness": result.staleness, "left_out": [list(map(str, e)) for e in result.left_out],
            "final": {k: v.tolist() for k, v in final.items()},
            "final_dtypes": {k: str(v.dtype) for k, v in final.items()}}


def run(grid: Grid, config) -> dict:
    """Run the configured strategy with Flower's start(); returns (and writes to ``out-file``) a summary."""
    name, model = str(cfg(config, "strategy")), str(cfg(config, "model"))
    if name == "fedbuff":
        return _report(run_fedbuff(grid, config, model), config)
    strategy = make_strategy(name, config)
    t0 = time.time()
    train_config = ConfigRecord({"compress": str(cfg(config, "compress"))}) if cfg(config, "compress") else None
    result = strategy.start(grid=grid, initial_arrays=initial_arrays(model),
                            num_rounds=int(cfg(config, "num-server-rounds")), timeout=600, train_config=train_config)
    final = {k: a.numpy() for k, a in result.arrays.items()}
    summary = {
        "strategy": name, "model": model,
        "rounds": int(cfg(config, "num-server-rounds")),
        "train": {str(r): dict(m) for r, m in result.train_metrics_clientapp.items()},
        # fastagg's strategies keep the server's statistics (FedExP's eta, ...) apart from the clients' metrics
        "server": {str(r): dict(m) for r, m in getattr(result, "train_metrics_serverapp", {}).items()},
        "eval": {str(r): dict(m) for r, m in result.evaluate_metrics_clientapp.items()},
        "final": {k: v.tolist() for k, v in final.items()},
        "final_dtypes": {k: str(v.dtype) for k, v in final.items()},
        "strategy_seconds": time.time() - t0,
    }
    return _report(summary, config)


def _report(summary: dict, config) -> dict:
    LAST_SUMMARY.clear()
    LAST_SUMMARY.update(summary)
    print("FASTAGG_RESULT " + json.dumps({k: v for k, v in summary.items() if k != "final"}), flush=True)
    if cfg(config, "out-file"):
        with open(str(cfg(config, "out-file")), "w") as f:
            json.dump(summary, f)
    return summary


@app.main()
def main(grid: Grid, context: Context) -> None:
    run(grid, context.run_config)
