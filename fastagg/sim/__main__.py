"""Command line of the simulator: ``python -m fastagg.sim`` (also installed as ``fastagg-sim``)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from .._checks import did_you_mean
from .._optional import MissingDependency, require
from . import algorithms, data
from .runner import Config, checked_settings, run, saved_config


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line and exit code 2."""

    def error(self, message):
        if message.startswith("unrecognized arguments: "):  # "did you mean" for a misspelled flag
            flags = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
            hints = [w + did_you_mean(w.split("=")[0], flags) if w.startswith("-") else w
                     for w in message[len("unrecognized arguments: "):].split()]
            message = "unrecognized arguments: " + " ".join(hints)
        self.exit(2, f"{self.prog}: error: {message}\n")


# the settings whose default (None) is the data set's paper setting (the epilog's table, eps below it)
DATASET_DEFAULTS = ("model", "clients", "participation", "local_steps", "batch_size", "lr", "rounds", "eps")


class _Help(argparse.RawDescriptionHelpFormatter):
    """Every option's default in --help: its value; "the data set's" where the data set's paper settings decide
    (``DATASET_DEFAULTS``); "none" for any other option left unset (off). An option whose help states its own
    default keeps it (tests/test_sim_files.py compares every one with the program)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default:" in text or action.default is argparse.SUPPRESS or not action.option_strings or \
                isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction)):
            return text
        shown = "%(default)s" if action.default is not None else "the data set's: table below" \
            if action.dest in DATASET_DEFAULTS else "none"
        return f"{text} (default: {shown})" if text else f"default: {shown}"


def _floats(text):
    return tuple(float(v) for v in text.split(","))


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fastagg-sim", formatter_class=_Help, epilog=EPILOG, description="Federated learning "
                "simulator: the clients of a round train together\nas rows of one [M, d] buffer with fastagg's fused "
                "kernels.")
    p.add_argument("--dataset", default="fedexp-linreg",
                   help=f"{', '.join(sorted(data.DATASETS))}, or npz:PATH (arrays x, y, optional client)")
    p.add_argument("--model", help="(default: the data set's own) linear | softmax | mlp | cnn | pfl-cnn, or your "
                   "own classifier as package.module:factory (factory(data) or factory() -> nn.Module over "
                   "data.num_features inputs, or (module, input_shape); built with torch seeded by the run's seed, 0 "
                   "when the seed scope is 'sampling'; --resume imports it only when named again here)")
    p.add_argument("--clients", type=int, help="number of clients (digits, synthetic, cifar-synthetic, npz)")
    p.add_argument("--dirichlet", type=float, help="digits and npz: Dirichlet label-split alpha (0 = IID; "
                   "default: 0.3)")
    p.add_argument("--config", help="a JSON, TOML (.toml) or YAML (.yaml / .yml, PyYAML) file of settings (keys "
                   "as in config.json; unknown keys are refused); flags given override it")
    p.add_argument("--algorithm", default="fedexp", help="comma-separated, each optionally with its own settings: "
                   "NAME[:KEY=VALUE...], e.g. fedavg:server_lr=10,fedexp. Names: "
                   f"{', '.join(sorted(algorithms.ALGORITHMS))}")
    p.add_argument("--rounds", type=int, help="communication rounds")
    p.add_argument("--participation", type=float, help="fraction of clients per round")
    p.add_argument("--local-steps", type=int, help="local steps per round")
    p.add_argument("--batch-size", type=int, help="0 = full batch")
    p.add_argument("--lr", type=float, help="local learning rate")
    p.add_argument("--lr-decay", type=float, default=1.0, help="per-round factor on the local lr")
    p.add_argument("--lr-c", type=float, help="paper 004's decaying lr: local iteration t (counted over all rounds) "
                   "uses min(lr, LR_C / (1 + t)) (default: none)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="local L2 weight decay")
    p.add_argument("--clip-norm", type=float, help="clip each local gradient to this norm (default: no clipping)")
    p.add_argument("--server-lr", type=float, help="server learning rate (default: the algorithm's: 1 for "
                   "FedAvg/FedProx/FedAvgM/SCAFFOLD, 0.1 FedAdam/FedAdagrad/FedAMS, 0.01 FedYogi; fedexp-linreg's "
                   "FedAvg 10)")
    p.add_argument("--server-momentum", type=float, default=0.9, help="FedAvgM's momentum (fastagg.server.FedAvgM's "
                   "own default is Flower's 0.0; paper 002 tunes it in {0.4, 0.6, 0.8})")
    p.add_argument("--weighting", default="examples", choices=["examples", "uniform"],
                   help="server average weighted by the clients' sample counts or uniform")
    p.add_argument("--eps", type=float, help="FedExP's eps (fedexp-linreg: 0)")
    p.add_argument("--eps-mode", default="paper", choices=["paper", "official"],
                   help="FedExP's eps: paper = eta's denominator 2(||mean||^2 + eps); official = the FedExP code's "
                   "eps, used as M * eps (docs/ALGORITHMS.md section 1)")
    p.add_argument("--eps-decay", type=float, default=1.0, help="per-round factor on FedExP's eps")
    p.add_argument("--lam", type=float, default=0.85, help="FedACG look-ahead / momentum")
    p.add_argument("--acg-beta", type=float, default=0.01, help="FedACG's local regularizer")
    p.add_argument("--prox-mu", type=float, default=0.01, help="FedProx")
    p.add_argument("--tau", type=float, default=1e-3, help="Adam family's adaptivity constant")
    p.add_argument("--sps-c", type=float, default=0.5, help="FedSPS c / FedDecSPS c0")
    p.add_argument("--gamma-b", type=float, default=1.0, help="FedSPS / FedDecSPS step cap")
    p.add_argument("--fedexpm-beta", type=float, default=0.9, help="FedExP-M server momentum")
    p.add_argument("--nesterov-momentum", type=float, default=0.1, help="paper 004's b_t (nesterov-fedavg)")
    p.add_argument("--mass-gam", type=float, default=0.1, help="FedMaSS gamma")
    p.add_argument("--mass-eta2", type=float, default=0.0, help="FedMaSS eta2")
    p.add_argument("--mass-average", default="w", choices=["w", "u"], help="what FedMaSS averages at a "
                   "synchronization: w (paper 004, App. G) or u (the extrapolated iterate; with eta2 = 0 it equals "
                   "nesterov-fedavg)")
    p.add_argument("--eval-every", type=int, default=1, help="evaluate the model (a metrics row) every this many "
                   "rounds, round 0 (the initial model) included, and after the last")
    p.add_argument("--eval-samples", type=int, help="measure the training loss on a fixed sample of this many of the "
                   "clients' samples (the same sample every round; least squares always uses all) (default: all, up "
                   "to 25000; cifar-synthetic: 2000)")
    p.add_argument("--attack", choices=["sign-flip", "gaussian", "scale", "label-flip", "alie", "ipm"],
                   help="Byzantine clients (default: none): how a fraction of the clients (see --malicious) "
                   "misbehaves; formulas in fastagg/sim/attacks.py")
    p.add_argument("--malicious", type=float, default=0.0, help="the fraction of the clients that attack, drawn "
                   "once per seed")
    p.add_argument("--attack-scale", type=float, help="the attack's strength (sign-flip 1, scale 10, gaussian 10, "
                   "ipm 0.5, alie: the paper's z) (default: the attack's)")
    p.add_argument("--dp", help="central differential privacy for every algorithm's server step: "
                   "server-fixed:clip=C,z=Z | server-adaptive:clip=C0,z=Z[,quantile=Q][,lr=L] | client-fixed:... | "
                   "client-adaptive:... (clip= and z= required; z = 0: no noise, else z >= 1e-3; adaptive quantile "
                   "0.5, lr 0.2 by default; optional delta=, default 1 / clients^1.1; seed=, an integer in [0, 2^64), "
                   "default derived from the run's seed); epsilon after each round in metrics.csv, the summary "
                   "and epsilon.png (fastagg/sim/privacy.py)")
    p.add_argument("--compress", help="what each client uploads, folded by the server where it lies: none (fp32) | "
                   "bf16 | fp16 | int8:block=256[,stochastic] | fp8:block=256 | qsgd:s=16[,bucket=N] | topk:0.01[,ef=1] | "
                   "randk:0.01[,ef=1] (error feedback on for the sparse kinds); metrics.csv gets bytes_sent, the "
                   "summary bytes_per_round (fastagg/compress/spec.py)")
    p.add_argument("--client-time", help="a virtual clock: how long each client trains, e.g. "
                   "exponential:mean=1,slow=0.1,factor=10 (10%% of the clients 10x slower) or lognormal:mu=0,sigma=0.5; "
                   "metrics.csv gets the virtual_time of every row (fastagg/sim/asynchronous.py); the async mode "
                   "needs it")
    p.add_argument("--mode", default="sync", choices=["sync", "async"], help="async: FedBuff/FedAsync through "
                   "fastagg.asynchronous.AsyncServer on the virtual clock (--client-time); --rounds counts server "
                   "steps (versions); not resumable")
    p.add_argument("--concurrency", type=int, help="async: clients training at once (default: participants per round)")
    p.add_argument("--buffer-size", type=int, help="async: updates per server step (default: half the "
                   "participants), at most the concurrency")
    p.add_argument("--staleness", default="polynomial:0.5", help="async: constant | polynomial:a | hinge:a,b "
                   "(exactly those numbers)")
    p.add_argument("--max-staleness", type=int, help="async: staler updates are refused, an integer >= 0 "
                   "(default: none)")
    p.add_argument("--target", type=float, help="a train loss; the summary reports the rounds to reach it "
                   "(default: none)")
    p.add_argument("--seed", type=int, default=None, help="one seed (overrides --seeds; default: --seeds)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds; the summary averages over them")
    p.add_argument("--seed-scope", default="all", choices=["all", "model", "sampling"],
                   help="what a seed varies: all (client sampling and minibatches, the initial model, the data "
                   "split), model (not the split), sampling (only sampling and minibatches)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "cpu", "triton"],
                   help="fastagg kernels: auto picks C++ on CPU, Triton on CUDA")
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false", help="on CUDA, run every local step "
                   "eagerly (default: stateless client rules replay each step from a CUDA graph)")
    p.add_argument("--dtype", choices=["float32", "float64"], help="(default: float64 for fedexp-linreg, float32 "
                   "otherwise)")
    p.add_argument("--out", help="folder for config.json, metrics.csv, summary.csv, checkpoint.pt and the plots "
                   "(default: none, nothing written)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint (with "
                   "the settings its config.json recorded); with a larger --rounds, extend a finished run")
    p.add_argument("--overwrite", action="store_true", help="replace the results of an earlier run in --out")
    return p


def _defaults_table() -> str:
    """The data sets' paper settings (data.PAPER_DEFAULTS) as the text table --help shows."""
    cols = [("model", "model"), ("clients", "clients"), ("participation", "particip."), ("local_steps", "steps"),
            ("batch_size", "batch"), ("lr", "lr"), ("rounds", "rounds"), ("eval_samples", "eval samples")]
    rows = [["data set"] + [title for _, title in cols]]
    for name, d in data.PAPER_DEFAULTS.items():
        shown = {**d, "batch_size": "full" if d["batch_size"] == 0 else d["batch_size"],
                 "eval_samples": d.get("eval_samples", "all")}
        rows.append([name] + [f"{shown[k]:g}" if isinstance(shown[k], float) else str(shown[k]) for k, _ in cols])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


EPILOG = """\
Defaults marked "the data set's" are the data set's paper settings:

{table}

eps (FedExP) is 1e-3 except fedexp-linreg's 0; fedexp-linreg runs FedAvg with server lr 10 (the FedExP paper's
Table 3); cifar-synthetic samples 50 clients a round (all of them when fewer); eval samples "all" means up to
25000. A run writes metrics.csv (one row per algorithm, seed and evaluated round: train loss of the reported and
last iterate, test loss and accuracy, the server step size eta, the wall time of the rounds since the previous
row -- local steps, server step, checkpoint -- and the evaluation's), summary.csv (per algorithm: final train loss
and test accuracy, mean and std over the finished seeds, rounds to --target, time per round, time per evaluation;
a seed stopped early gets a row of its own, marked unfinished) and loss/accuracy/eta plots.
Momentum methods (nesterov-fedavg, fedmass) keep each client's momentum state between its rounds: under partial
participation a returning client continues from stale state. The update rules and the conventions fixed where
the papers and their code differ: docs/ALGORITHMS.md.
""".replace("{table}", _defaults_table())

# Config fields the flags set (flag dest -> Config field), for --config and --resume
FLAG_FIELDS = {"dataset": "dataset", "clients": "clients", "dirichlet": "dirichlet", "model": "model",
               "algorithm": "algorithms", "rounds": "rounds", "participation": "participation",
               "local_steps": "local_steps", "batch_size": "batch_size", "lr": "lr", "lr_decay": "lr_decay",
               "lr_c": "lr_c",
               "weight_decay": "weight_decay", "clip_norm": "clip_norm", "server_lr": "server_lr",
               "server_momentum": "server_momentum", "weighting": "weighting", "eps": "eps", "eps_mode": "eps_mode",
               "eps_decay": "eps_decay", "lam": "lam", "acg_beta": "acg_beta", "prox_mu": "prox_mu", "tau": "tau",
               "sps_c": "sps_c", "gamma_b": "gamma_b", "fedexpm_beta": "fedexpm_beta",
               "nesterov_momentum": "nesterov_momentum", "mass_gam": "mass_gam", "mass_eta2": "mass_eta2",
               "mass_average": "mass_average", "target": "target", "eval_every": "eval_every", "eval_samples": "eval_samples", "seeds": "seeds",
               "seed": "seeds", "seed_scope": "seed_scope", "attack": "attack", "malicious": "malicious",
               "attack_scale": "attack_scale", "dp": "dp", "compress": "compress", "client_time": "client_time", "mode": "mode",
               "concurrency": "concurrency", "buffer_size": "buffer_size", "staleness": "staleness",
               "max_staleness": "max_staleness", "device": "device", "backend": "backend", "dtype": "dtype",
               "cuda_graph": "cuda_graph"}


def _seeds(a) -> tuple:
    if a.seed is not None:
        return (a.seed,)
    try:
        return tuple(int(s) for s in a.seeds.split(","))
    except ValueError:
        raise ValueError(f"--seeds {a.seeds!r}: expected comma-separated integers (e.g. 0,1,2)") from None


def _read_config(path: str) -> dict:
    """A JSON file, TOML when the name ends in .toml, YAML in .yaml / .yml (PyYAML, the [sim] extra; its safe
    loader: plain data only). Top-level keys are settings; a table named like an entry of ``algorithms`` holds
    that algorithm's own settings (``runner.checked_settings``)."""
    if path.endswith((".yaml", ".yml")):
        require("yaml", "sim", "a YAML --config")
        import yaml

        class UniqueKeys(yaml.SafeLoader):  # the safe loader, refusing a key given twice (it takes the last)
            def construct_mapping(self, node, deep=False):
                seen = set()
                for key_node, _ in node.value:
                    key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
                    if key is not None and key != "<<" and key in seen:
                        raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice",
                                                                key_node.start_mark)
                    seen.add(key)
                return super().construct_mapping(node, deep=deep)

        try:
            with open(path) as f:
                return yaml.load(f, Loader=UniqueKeys)  # noqa: S506 (a SafeLoader)
        except RecursionError:
            raise ValueError(f"cannot read --config {path!r}: nested too deeply") from None
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"cannot read --config {path!r}: {' '.join(str(e).split())}") from None
    try:
        if path.endswith(".toml"):
            try:
                import tomllib
            except ImportError:  # Python 3.10
                raise ValueError("TOML needs Python 3.11+ (tomllib); use JSON") from None
            with open(path, "rb") as f:
                return tomllib.load(f)
        with open(path) as f:
            return json.load(f, object_pairs_hook=_unique_keys)
    except RecursionError:  # a JSON or TOML file nested thousands deep
        raise ValueError(f"cannot read --config {path!r}: nested too deeply") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read --config {path!r}: {e}") from None


def _unique_keys(pairs: list) -> dict:
    """A JSON object whose keys are all different: json takes the last of a key given twice, silently."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} is given twice")
        out[key] = value
    return out


def _given(argv) -> set:
    """The flag dests given on the command line (not defaulted)."""
    p = parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS
    return set(vars(p.parse_args(argv)))


def _config(a, argv) -> tuple:
    """(the run's Config, the fields the command line set): a --config file's settings (checked), with the flags
    given on the command line on top."""
    settings = {}
    if a.config:
        settings = checked_settings(_read_config(a.config), f"--config {a.config!r}")
    given = _given(argv)
    flags = dict(dataset=a.dataset, clients=a.clients, dirichlet=a.dirichlet, model=a.model,
                 algorithms=tuple(x.strip() for x in a.algorithm.split(",")), rounds=a.rounds,
                 participation=a.participation,
                 local_steps=a.local_steps, batch_size=a.batch_size, lr=a.lr, lr_decay=a.lr_decay,
                 lr_c=a.lr_c,
                 weight_decay=a.weight_decay, clip_norm=a.clip_norm, server_lr=a.server_lr,
                 server_momentum=a.server_momentum, weighting=a.weighting, eps=a.eps, eps_mode=a.eps_mode,
                 eps_decay=a.eps_decay, lam=a.lam, acg_beta=a.acg_beta, prox_mu=a.prox_mu, tau=a.tau,
                 sps_c=a.sps_c, gamma_b=a.gamma_b, fedexpm_beta=a.fedexpm_beta,
                 nesterov_momentum=a.nesterov_momentum, mass_gam=a.mass_gam, mass_eta2=a.mass_eta2,
                 mass_average=a.mass_average, target=a.target, eval_every=a.eval_every,
                 eval_samples=a.eval_samples, seeds=_seeds(a), seed_scope=a.seed_scope, attack=a.attack,
                 malicious=a.malicious, attack_scale=a.attack_scale, dp=a.dp, compress=a.compress,
                 client_time=a.client_time,
                 mode=a.mode, concurrency=a.concurrency, buffer_size=a.buffer_size, staleness=a.staleness,
                 max_staleness=a.max_staleness,
                 device=a.device, backend=a.backend, cuda_graph=a.cuda_graph, dtype=a.dtype, out=a.out)
    explicit = {FLAG_FIELDS[k] for k in given if k in FLAG_FIELDS} | ({"out"} if "out" in given else set())
    merged = {**flags, **{k: v for k, v in settings.items() if k not in explicit}}
    return Config(**merged), explicit


def _check_resume(cfg: Config, explicit: set) -> None:
    """--resume continues a run as its config.json recorded it: flags that would change a setting are refused,
    except a larger --rounds, which extends the run (run() checks it)."""
    saved = saved_config(cfg.out)
    changed = [f for f in sorted(explicit - {"out", "rounds"}) if f in saved and
               (tuple(saved[f]) if isinstance(saved[f], (list, tuple)) else saved[f]) != getattr(cfg, f)]
    if changed:
        shown = ", ".join(f"{f} ({getattr(cfg, f)!r}; the run has {saved[f]!r})" for f in changed)
        raise ValueError(f"--resume continues {cfg.out!r} with its recorded settings; these flags would change them: "
                         f"{shown}")


def main(argv=None) -> int:
    """Exit codes: 0 done, 1 a run stopped (non-finite loss, Ctrl-C), 2 a usage or input error (one line)."""
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    try:
        cfg, explicit = _config(a, argv)
        if a.resume:
            _check_resume(cfg, explicit)
        elif cfg.out is None and a.overwrite:  # --out may come from the --config file
            raise ValueError("--overwrite needs --out")
        history = run(cfg, verbose=True, resume=a.resume, overwrite=a.overwrite)
    except (ValueError, TypeError, MissingDependency) as e:
        _leave_group(finished=False)
        if os.environ.get("FASTAGG_DEBUG"):
            raise
        print(f"fastagg-sim: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    _leave_group(finished=True)
    if history.stopped:
        print(f"stopped: {history.stopped}", file=sys.stderr)
        return 1
    if history.config.out:  # rank 0 alone writes under torchrun
        print(f"wrote {cfg.out}/config.json, metrics.csv and the PNG plots")
    return 0


def _leave_group(finished: bool) -> None:
    """Under torchrun, tear the process group down before the interpreter exits: a gloo group left to die during
    interpreter shutdown aborts the process now and then ('terminate called without an active exception', a rank
    exiting -6 after a finished run). After a finished run every rank waits for the others first; after an error
    it does not wait (the others raised too, or will at their group's timeout)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if finished:
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
