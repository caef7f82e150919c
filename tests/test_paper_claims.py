"""One robust claim per paper, as a test that prints what it saw (paper 000's, FedExP on its linear regression, is
in test_sim.py). The full experiments, on set-ups closer to the papers', are python -m fastagg.sim.reproduce
(REPRODUCTION.md)."""
from __future__ import annotations

import numpy as np

from fastagg.sim.reproduce import ema
from fastagg.sim.runner import Config, run


def test_paper_003_fedsps_needs_no_tuning_when_the_clients_share_an_optimum():
    """Paper 003 (FedSPS): in the interpolation regime the Polyak step needs no lr. On its two-client quadratic
    (f_1 = x^2, f_2 = x^2 / 2, both minimal at 0) FedSPS lands on the optimum in the first round; FedAvg at the data
    set's lr converges linearly (a factor ~5 a round)."""
    h = run(Config(dataset="quadratic", algorithms=("fedsps", "fedavg"), rounds=10, sps_c=0.5, gamma_b=100.0))
    sps, avg = h.series("fedsps", "train_loss"), h.series("fedavg", "train_loss")
    print(f"\ntrain loss by round: FedSPS {[f'{v:.2e}' for v in sps[:4]]}, FedAvg {[f'{v:.2e}' for v in avg[:4]]} ... "
          f"round 10: FedSPS {sps[-1]:.2e}, FedAvg {avg[-1]:.2e}")
    assert sps[0] > 0.1 and sps[1] < 1e-20 and sps[-1] < 1e-20
    assert avg[1] > 0.1 * avg[0] and avg[-1] > 1e-12


def test_paper_004_geometric_convergence_and_local_momentum_when_the_model_interpolates():
    """Paper 004: when the loss can reach zero (overparameterized least squares: the FedExP paper's regression has
    600 samples and 1000 parameters), local SGD converges geometrically, and Nesterov local momentum (b = 0.1, the
    paper's) is ahead of plain local steps. FedAvg at the FedExP paper's server lr 10 loses a factor >= 20 every 100
    rounds from round 100 to 400; Nesterov FedAvg is below FedAvg with the same server lr (1) at every 50th round."""
    h = run(Config(dataset="fedexp-linreg", algorithms=("fedavg", "fedavg:server_lr=1", "nesterov-fedavg"),
                   rounds=400, nesterov_momentum=0.1))
    fast = np.array(h.series("fedavg", "train_loss"))
    plain, nesterov = np.array(h.series("fedavg:server_lr=1", "train_loss")), \
        np.array(h.series("nesterov-fedavg", "train_loss"))
    checkpoints = list(range(50, 401, 50))
    factors = [fast[t] / fast[t + 100] for t in (100, 200, 300)]
    print(f"\nFedAvg (server lr 10): F at 0/100/200/300/400 {[f'{fast[t]:.2e}' for t in (0, 100, 200, 300, 400)]}, "
          f"factor per 100 rounds {[f'{f:.0f}' for f in factors]}")
    print("FedAvg (server lr 1) vs Nesterov FedAvg: " +
          ", ".join(f"{t}: {plain[t]:.4f} / {nesterov[t]:.4f}" for t in checkpoints))
    assert all(f >= 20 for f in factors)
    assert all(nesterov[t] < plain[t] for t in checkpoints)


def test_paper_002_fedacg_reaches_the_target_before_fedavg_at_low_participation():
    """Paper 002 (FedACG): with few clients a round on non-IID data, FedACG's momentum look-ahead reaches a target
    accuracy in fewer rounds than FedAvg. Digits, 50 Dirichlet(0.3) clients, 5 a round, 20 local steps: the rounds
    to 90% EMA-0.9 test accuracy, per seed (REPRODUCTION.md claim 4: 31 vs 40 rounds over 5 seeds)."""
    seeds = (0, 1)
    h = run(Config(dataset="digits", clients=50, dirichlet=0.3, model="mlp", participation=0.1, local_steps=20,
                   batch_size=20, lr=0.05, weight_decay=1e-3, algorithms=("fedacg", "fedavg"), rounds=60, seeds=seeds))
    hits = {a: [next((t for t, v in enumerate(ema(h.series(a, "test_acc", s))) if v >= 0.9), None) for s in seeds]
            for a in ("fedacg", "fedavg")}
    print(f"\nrounds to 90% EMA test accuracy by seed: FedACG {hits['fedacg']}, FedAvg {hits['fedavg']}")
    assert None not in hits["fedacg"]
    assert all(f is None or a < f for a, f in zip(hits["fedacg"], hits["fedavg"]))
