"""Federated data sets built in memory (no downloads), padded to one tensor per field so a round's clients train
together: ``x [N, n_max, f]``, ``y [N, n_max]`` (targets or class labels), ``counts [N]`` (each client's true
number of samples; rows past it are padding and never used).
"""
from __future__ import annotations

import inspect

import dataclasses
import functools

import zipfile

import numpy as np
import torch

from .._checks import check_int
from .._optional import require

__all__ = ["FederatedData", "fedexp_linreg", "synthetic", "quadratic", "digits", "cifar_synthetic", "dirichlet_split",
           "DATASETS", "load"]


# Each data set's paper settings: what a run uses where it leaves a setting unset (``--help`` prints this table).
# Settings that depend on the data set's arguments (its number of clients) are filled in by its builder.
PAPER_DEFAULTS = {
    "fedexp-linreg": dict(clients=20, participation=1.0, batch_size=0, local_steps=20, lr=0.1, eps=0.0, model="linear",
                          rounds=200),
    "synthetic": dict(clients=30, participation=1.0, batch_size=20, local_steps=5, lr=0.1, model="softmax",
                      rounds=300),
    "synthetic-iid": dict(clients=10, participation=1.0, batch_size=20, local_steps=5, lr=0.1, model="softmax",
                          rounds=300),
    "quadratic": dict(clients=2, participation=1.0, batch_size=0, local_steps=5, lr=0.1, model="quadratic", rounds=50),
    "digits": dict(clients=20, participation=0.25, batch_size=20, local_steps=5, lr=0.05, model="mlp", rounds=300),
    "digits-noisy": dict(clients=20, participation=0.25, batch_size=20, local_steps=5, lr=0.05, model="mlp",
                         rounds=300),
    "cifar-synthetic": dict(clients=1000, participation=0.05, batch_size=10, local_steps=5, lr=0.05, model="pfl-cnn",
                            rounds=100, eval_samples=2000),
    "w8a-like": dict(clients=1, participation=1.0, batch_size=4, local_steps=5, lr=0.5, model="softmax", rounds=400),
    "npz:PATH": dict(clients=20, participation=1.0, batch_size=20, local_steps=5, lr=0.05, model="softmax or linear",
                     rounds=100),
}


@dataclasses.dataclass
class FederatedData:
    name: str
    x: torch.Tensor            # [N, n_max, f]
    y: torch.Tensor            # [N, n_max] float targets or int64 labels
    counts: torch.Tensor       # [N] int64
    task: str                  # "least_squares" | "classification" | "quadratic"
    num_classes: int = 0
    defaults: dict = dataclasses.field(default_factory=dict)  # the paper's settings for this data set
    test_x: torch.Tensor | None = None  # held-out test set [n_test, f] (one pool, not split by client)
    test_y: torch.Tensor | None = None

    # the training loss is measured on at most this many of the clients' samples (a fixed uniform sample, the same
    # every round and run); None: all of them
    eval_limit: int | None = None

    _samples: tuple | None = dataclasses.field(default=None, repr=False, compare=False)

    def samples(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The clients' real samples the training loss is measured on, padding dropped: ``(x [n, f], y [n])``,
        built once. All of them, or with ``eval_limit`` a fixed uniform sample of that many (drawn with seed 0, in
        the clients' order), gathered without copying the rest (padded rows are 7x the real ones in Synthetic(1,
        1), whose clients hold 50-5162)."""
        if self._samples is None:
            keep = torch.arange(self.x.shape[1], device=self.x.device)[None, :] < self.counts[:, None]
            rows = keep.flatten().nonzero().squeeze(1)
            if self.eval_limit is not None and len(rows) > self.eval_limit:
                pick = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))[:self.eval_limit]
                rows = rows[pick.sort().values.to(rows.device)]
            self._samples = (self.x.flatten(0, 1)[rows], self.y.flatten(0, 1)[rows])
        return self._samples

    @property
    def num_samples(self) -> int:
        """The clients' real samples, all of them."""
        return int(self.counts.sum())

    @property
    def num_clients(self) -> int:
        return self.x.shape[0]

    @property
    def num_features(self) -> int:
        return self.x.shape[2]

    def to(self, device, dtype) -> "FederatedData":
        y = self.y.to(device) if self.task == "classification" else self.y.to(device, dtype)
        test = {}
        if self.test_x is not None:
            test_y = self.test_y.to(device) if self.task == "classification" else self.test_y.to(device, dtype)
            test = dict(test_x=self.test_x.to(device, dtype), test_y=test_y)
        return dataclasses.replace(self, x=self.x.to(device, dtype), y=y, counts=self.counts.to(device), _samples=None,
                                   **test)

    def with_eval_limit(self, limit: int | None) -> "FederatedData":
        """The same data, its training loss measured on at most ``limit`` samples (:meth:`samples`)."""
        return dataclasses.replace(self, eval_limit=limit, _samples=None)


def _pad(xs: list, ys: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n_max = max(len(x) for x in xs)
    f = xs[0].shape[1]
    x = np.zeros((len(xs), n_max, f))
    y = np.zeros((len(xs), n_max), dtype=ys[0].dtype)
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        x[i, : len(xi)] = xi
        y[i, : len(yi)] = yi
    return torch.from_numpy(x), torch.from_numpy(y), torch.tensor([len(v) for v in xs], dtype=torch.int64)


@functools.lru_cache(maxsize=1)  # read-only afterwards
def fedexp_linreg() -> FederatedData:
    """FedExP's overparameterized linear regression (paper 000, App. D; the official notebook's recipe): 20 clients,
    30 samples each, d = 1000; rows and each client's targets normalized to unit L2 norm, so ``F(0) = 1``.

    The notebook draws ``multivariate_normal(mean_x[i], I, 30)``; numpy computes that as ``mean + z @ (sqrt(s) v)``
    with ``(u, s, v) = svd(I) = (I, 1, I)`` and ``z`` standard normal draws, so ``mean + z`` is the same numbers
    from the same stream without 20 SVDs of a 1000 x 1000 matrix (5 s; ``test_sim.py`` checks they are equal)."""
    rng = np.random.RandomState(0)
    clients, samples, dim = 20, 30, 1000
    mean_w = rng.normal(0, 0.1, clients)
    b = rng.normal(0, 0.1, clients)
    mean_x = [rng.normal(b[i], 1, dim) for i in range(clients)]
    xs, ys = [], []
    for i in range(clients):
        w_i = rng.normal(mean_w[i], 1, (dim, 1))
        x_i = mean_x[i] + rng.standard_normal((samples, dim))  # = rng.multivariate_normal(mean_x[i], I, samples)
        y_i = (x_i @ w_i)[:, 0]
        xs.append(x_i / np.linalg.norm(x_i, axis=1, keepdims=True))
        ys.append(y_i / np.linalg.norm(y_i))
    x, y, counts = _pad(xs, ys)
    return FederatedData("fedexp-linreg", x, y, counts, "least_squares",
                         defaults=dict(PAPER_DEFAULTS["fedexp-linreg"],
                                       # the paper's Table 3 and notebook: FedAvg with server lr 10
                                       algorithms={"fedavg": dict(server_lr=10.0)}))


def synthetic_iid(num_clients: int = 10, alpha: float = 1.0, beta: float = 1.0, seed: int = 0) -> FederatedData:
    """Synthetic(alpha, beta)'s 30 clients' samples pooled and split IID across ``num_clients`` (linear speedup:
    N clients sharing the same data)."""
    base = synthetic(alpha, beta, 30, seed)
    keep = torch.arange(base.x.shape[1])[None, :] < base.counts[:, None]
    x, y = base.x[keep].numpy(), base.y[keep].numpy()
    parts = dirichlet_split(y, num_clients, 0, np.random.RandomState(seed))
    xp, yp, counts = _pad([x[p] for p in parts], [y[p] for p in parts])
    return dataclasses.replace(base, name=f"synthetic-iid({alpha:g},{beta:g})x{num_clients}", x=xp, y=yp,
                               counts=counts, defaults={**base.defaults, "clients": num_clients})


def synthetic(alpha: float = 1.0, beta: float = 1.0, num_clients: int = 30, seed: int = 0) -> FederatedData:
    """Synthetic(alpha, beta) of FedProx: per client u ~ N(0, alpha), B ~ N(0, beta), W ~ N(u, 1) [10 x 60],
    b ~ N(u, 1), v ~ N(B, 1), x ~ N(v, diag(j^-1.2)), label argmax(W x + b); int(lognormal(4, 2)) + 50 samples."""
    rng = np.random.RandomState(seed)
    dim, classes = 60, 10
    sigma = np.array([(j + 1) ** -1.2 for j in range(dim)])
    sizes = rng.lognormal(4, 2, num_clients).astype(int) + 50
    xs, ys = [], []
    for k in range(num_clients):
        u, bk = rng.normal(0, alpha), rng.normal(0, beta)
        w = rng.normal(u, 1, (classes, dim))
        bias = rng.normal(u, 1, classes)
        v = rng.normal(bk, 1, dim)
        x = rng.normal(v, np.sqrt(sigma), (sizes[k], dim))
        xs.append(x)
        ys.append(np.argmax(x @ w.T + bias, axis=1).astype(np.int64))
    x, y, counts = _pad(xs, ys)
    return FederatedData(f"synthetic({alpha:g},{beta:g})", x, y, counts, "classification", num_classes=classes,
                         defaults=dict(PAPER_DEFAULTS["synthetic"], clients=num_clients))


def quadratic(a: float = 2.0) -> FederatedData:
    """Paper 003's example: f_1(x) = (a/2) x^2, f_2(x) = (1/2) x^2 (two clients, one parameter)."""
    x = torch.tensor([[[a]], [[1.0]]], dtype=torch.float64)  # curvature per client
    return FederatedData("quadratic", x, torch.zeros(2, 1, dtype=torch.float64), torch.ones(2, dtype=torch.int64),
                         "quadratic", defaults=dict(PAPER_DEFAULTS["quadratic"]))


def dirichlet_split(labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.RandomState,
                    min_size: int = 1) -> list:
    """Per class, client proportions from Dirichlet(alpha); that class's samples are dealt accordingly. Redrawn
    until every client holds at least ``min_size`` samples. ``alpha = 0`` means IID: a random equal split.
    Returns each client's sample indices."""
    if alpha == 0:
        return [np.sort(p) for p in np.array_split(rng.permutation(len(labels)), num_clients)]
    classes = np.unique(labels)
    for _ in range(1000):
        parts = [[] for _ in range(num_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            cuts = (np.cumsum(rng.dirichlet(alpha * np.ones(num_clients))) * len(idx)).astype(int)[:-1]
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.array(sorted(p)) for p in parts]
    raise ValueError(f"no Dirichlet({alpha}) split of {len(labels)} samples gives each of {num_clients} clients "
                     f"{min_size} samples; use fewer clients or a larger alpha")


def digits(num_clients: int = 20, alpha: float = 0.3, seed: int = 0, test_fraction: float = 0.2,
           min_size: int = 8, label_noise: float = 0.0) -> FederatedData:
    """scikit-learn's bundled digits (1797 8x8 images, 10 classes; no download), pixels scaled to [0, 1]; a
    stratified ``test_fraction`` is held out, the rest split across clients by a Dirichlet(alpha) label partition
    (alpha = 0.3 as in the FedExP/FedACG experiments). ``label_noise``: the fraction of training labels replaced by
    another class drawn uniformly (the test labels stay clean), so no model interpolates the training set."""
    require("sklearn", "sim", "the digits data set")
    from sklearn.datasets import load_digits

    ds = load_digits()
    x, y = ds.data / 16.0, ds.target.astype(np.int64)
    rng = np.random.RandomState(seed)
    test = np.concatenate([rng.permutation(np.flatnonzero(y == c))[: int(round(test_fraction * (y == c).sum()))]
                           for c in range(10)])
    train = np.setdiff1d(np.arange(len(y)), test)
    if label_noise:
        y = y.copy()
        flip = train[rng.permutation(len(train))[: int(round(label_noise * len(train)))]]
        y[flip] = (y[flip] + rng.randint(1, 10, len(flip))) % 10
    parts = dirichlet_split(y[train], num_clients, alpha, rng, min_size)
    xp, yp, counts = _pad([x[train][p] for p in parts], [y[train][p] for p in parts])
    return FederatedData("digits-noisy" if label_noise else "digits", xp, yp, counts, "classification", num_classes=10,
                         defaults=dict(PAPER_DEFAULTS["digits"], clients=num_clients),
                         test_x=torch.from_numpy(x[test]), test_y=torch.from_numpy(y[test]))


def cifar_synthetic(num_clients: int = 1000, per_client: int = 50, seed: int = 0,
                    test_size: int = 1000) -> FederatedData:
    """CIFAR-10-shaped synthetic images for pfl-research's CIFAR-10 benchmark workload without a download: 32x32x3
    standard-normal pixels (channels first, flattened to 3072 features), ``per_client`` images per client (50 x
    1000 clients = CIFAR-10's 50,000 training images), labels from a fixed random linear teacher on 4x4-pooled
    pixels (so a model can learn them), a held-out test set. Defaults: 50 clients a round, batch 10, 5 local steps
    (one local epoch), the pfl CNN."""
    g = torch.Generator().manual_seed(seed)
    n = num_clients * per_client + test_size
    x = torch.randn(n, 3, 32, 32, generator=g)
    teacher = torch.randn(3 * 8 * 8, 10, generator=g, dtype=torch.float64)
    pooled = torch.nn.functional.avg_pool2d(x, 4).flatten(1).double()
    y = (pooled @ teacher).argmax(1)
    x = x.flatten(1)
    train = num_clients * per_client
    return FederatedData("cifar-synthetic", x[:train].view(num_clients, per_client, -1),
                         y[:train].view(num_clients, per_client),
                         torch.full((num_clients,), per_client, dtype=torch.int64), "classification", num_classes=10,
                         defaults=dict(PAPER_DEFAULTS["cifar-synthetic"], clients=num_clients,
                                       participation=50 / num_clients if num_clients >= 50 else 1.0),
                         test_x=x[train:], test_y=y[train:])


def digits_noisy(num_clients: int = 20, alpha: float = 0.3, seed: int = 0) -> FederatedData:
    """``digits`` with 20% of the training labels replaced by another class (paper 003's non-interpolating case)."""
    return digits(num_clients, alpha, seed, label_noise=0.2)


def w8a_like(num_clients: int = 1, num_samples: int = 20_000, num_features: int = 300, density: float = 0.04,
             seed: int = 0) -> FederatedData:
    """A stand-in for LIBSVM's w8a (paper 004's speedup study; no download here): ``num_samples`` sparse binary
    feature vectors (300 features, ~4% ones, as w8a's), labels from a random logistic teacher (so the optimum is
    not at zero loss), split IID over ``num_clients``; binary logistic regression as a 2-class softmax."""
    rng = np.random.RandomState(seed)
    x = (rng.rand(num_samples, num_features) < density).astype(np.float64)
    teacher = rng.randn(num_features) * 2.0
    p = 1.0 / (1.0 + np.exp(-(x @ teacher - np.median(x @ teacher))))
    y = (rng.rand(num_samples) < p).astype(np.int64)
    parts = np.array_split(rng.permutation(num_samples), num_clients)
    xp, yp, counts = _pad([x[i] for i in parts], [y[i] for i in parts])
    return FederatedData("w8a-like", xp, yp, counts, "classification", num_classes=2,
                         defaults=dict(PAPER_DEFAULTS["w8a-like"], clients=num_clients))


DATASETS = {"fedexp-linreg": fedexp_linreg, "synthetic": synthetic, "synthetic-iid": synthetic_iid,
            "quadratic": quadratic, "digits": digits, "digits-noisy": digits_noisy,
            "cifar-synthetic": cifar_synthetic, "w8a-like": w8a_like}


def from_npz(path: str, *, num_clients: int = 20, alpha: float = 0.3, seed: int = 0) -> FederatedData:
    """A user's arrays: ``x`` [n, features...] (flattened), ``y`` [n] (integer class labels, or floats for least
    squares), optional ``client`` [n] (each sample's client id, 0..N-1); without it a Dirichlet(alpha) label split
    over ``num_clients`` (alpha 0: IID; float targets are split IID). Optional ``x_test`` and ``y_test`` (together)
    are a held-out test set, evaluated every round; optional ``num_classes`` (a scalar) fixes the number of classes
    (default: the largest label in y or y_test, plus one) and every label must lie below it.

    Every array is checked before use; a bad file gets one ValueError naming the array and the problem: finite
    numeric features, labels that are integers >= 0 (classification) or finite floats, client ids that are
    integers >= 0 with every client 0..N-1 holding a sample. The file is read without pickles."""
    where = f"npz data set {path!r}"
    try:
        arrays = np.load(path, allow_pickle=False)
        if not isinstance(arrays, np.lib.npyio.NpzFile):
            raise ValueError("is a single array (.npy); a data set is an .npz file holding 'x' and 'y' "
                             "(numpy.savez)")
        _check_headers(arrays)
        missing = [k for k in ("x", "y") if k not in arrays.files]
        if missing:
            raise ValueError(f"has no array {missing[0]!r} (needs 'x' and 'y', optional 'client')")
        x_raw, y, owner = arrays["x"], np.asarray(arrays["y"]), \
            (np.asarray(arrays["client"]) if "client" in arrays.files else None)
        if ("x_test" in arrays.files) != ("y_test" in arrays.files):
            raise ValueError("has only one of 'x_test' and 'y_test' (a test set needs both)")
        test = (arrays["x_test"], np.asarray(arrays["y_test"])) if "x_test" in arrays.files else None
        num_classes = np.asarray(arrays["num_classes"]) if "num_classes" in arrays.files else None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"cannot read {where}: {e}") from e
    x = _features(x_raw, "x", where)
    classification = np.issubdtype(y.dtype, np.integer)
    _check_targets(y, "y", len(x), classification, where)
    if test is not None:
        test_x = _features(test[0], "x_test", where)
        if test_x.shape[1] != x.shape[1]:
            raise ValueError(f"{where}: 'x_test' has {test_x.shape[1]} features per sample, 'x' {x.shape[1]}")
        if np.issubdtype(test[1].dtype, np.integer) != classification:
            raise ValueError(f"{where}: 'y_test' has dtype {test[1].dtype} but 'y' {y.dtype} (both integer class "
                             "labels or both float targets)")
        _check_targets(test[1], "y_test", len(test_x), classification, where)
    n_classes = 0
    if classification:
        largest = max(int(y.max()), int(test[1].max()) if test is not None else 0)
        wanted = largest + 1
        if num_classes is not None and num_classes.shape == () and np.issubdtype(num_classes.dtype, np.integer):
            wanted = max(wanted, int(num_classes))
        if wanted > MAX_CLASSES:  # a model of that many outputs would be allocated: refused first
            raise ValueError(f"{where}: its labels or num_classes ask for {wanted} classes; at most {MAX_CLASSES} "
                             "are supported")
        if num_classes is None:
            n_classes = largest + 1
        else:
            if num_classes.shape != () or not np.issubdtype(num_classes.dtype, np.integer) or int(num_classes) < 1:
                raise ValueError(f"{where}: 'num_classes' must be one integer >= 1, got {num_classes!r}")
            n_classes = int(num_classes)
            for name, labels in (("y", y), ("y_test", test[1] if test is not None else y)):
                if int(labels.max()) >= n_classes:
                    raise ValueError(f"{where}: {name!r} holds class label {int(labels.max())}, out of range for "
                                     f"num_classes = {n_classes} (labels are 0..{n_classes - 1})")
    rng = np.random.RandomState(seed)
    if owner is not None:
        if owner.ndim != 1 or len(owner) != len(x):
            raise ValueError(f"{where}: 'client' must be 1-D with one id per sample ({len(x)}), got shape "
                             f"{owner.shape}")
        if not np.issubdtype(owner.dtype, np.integer):
            raise ValueError(f"{where}: 'client' must hold integer client ids, got dtype {owner.dtype}")
        if (owner < 0).any():
            raise ValueError(f"{where}: 'client' holds negative ids (e.g. {int(owner[owner < 0][0])})")
        if int(owner.max()) >= len(x):  # ids 0..N-1 each used: N is at most the number of samples
            raise ValueError(f"{where}: 'client' holds id {int(owner.max())} but there are only {len(x)} samples "
                             "(ids must be 0..N-1, each used)")
        n_clients = int(owner.max()) + 1
        empty = np.setdiff1d(np.arange(n_clients), owner)
        if len(empty):
            raise ValueError(f"{where}: client {int(empty[0])} has no sample ('client' ids must be 0..N-1, each "
                             "used)")
        parts = [np.flatnonzero(owner == k) for k in range(n_clients)]
    else:
        parts = dirichlet_split(y if classification else np.zeros(len(y)), num_clients,
                                alpha if classification else 0.0, rng)
    xp, yp, counts = _pad([x[p] for p in parts], [y[p].astype(np.int64 if classification else np.float64)
                                                  for p in parts])
    task = "classification" if classification else "least_squares"
    test_x = test_y = None
    if test is not None:
        test_x = torch.from_numpy(_features(test[0], "x_test", where))
        test_y = torch.from_numpy(test[1].astype(np.int64 if classification else np.float64))
    return FederatedData(f"npz:{path}", xp, yp, counts, task, num_classes=n_classes,
                         defaults=dict(PAPER_DEFAULTS["npz:PATH"], clients=len(counts),
                                       model="softmax" if classification else "linear"),
                         test_x=test_x, test_y=test_y)


MAX_CLASSES = 1 << 20  # a label beyond this is a corrupt file, not a data set: refused before any model is built


def _check_headers(arrays) -> None:
    """Every array's header against the bytes its member holds, before any array is read: a header that claims more
    data than the file has (a corrupt or hostile file) would otherwise make numpy allocate what the header says."""
    for info in arrays.zip.infolist():
        with arrays.zip.open(info) as f:
            try:
                version = np.lib.format.read_magic(f)
                if version == (1, 0):
                    shape, _, dtype = np.lib.format.read_array_header_1_0(f)
                else:
                    shape, _, dtype = np.lib.format.read_array_header_2_0(f)
            except ValueError as e:
                raise ValueError(f"member {info.filename!r} is not a numpy array ({e})") from None
            claimed = int(np.prod(shape, dtype=object)) * dtype.itemsize
            held = info.file_size - f.tell()
            if claimed > held:
                raise ValueError(f"member {info.filename!r} claims {claimed} bytes of data ({dtype} of shape "
                                 f"{shape}) but holds {held}")


def _features(raw: np.ndarray, name: str, where: str) -> np.ndarray:
    if raw.dtype.kind not in "iuf" or raw.ndim < 1 or len(raw) == 0:
        raise ValueError(f"{where}: {name!r} must be a non-empty numeric array [n, features...], got dtype "
                         f"{raw.dtype} shape {raw.shape}")
    x = np.asarray(raw, dtype=np.float64).reshape(len(raw), -1)
    if not np.isfinite(x).all():
        raise ValueError(f"{where}: {name!r} holds NaN or Inf (sample {int(np.argwhere(~np.isfinite(x))[0, 0])})")
    return x


def _check_targets(y: np.ndarray, name: str, n: int, classification: bool, where: str) -> None:
    if y.ndim != 1 or len(y) != n:
        raise ValueError(f"{where}: {name!r} must be 1-D with one entry per sample ({n}), got shape {y.shape}")
    if classification and (y < 0).any():
        raise ValueError(f"{where}: {name!r} holds negative class labels (e.g. {int(y[y < 0][0])}); labels are "
                         "0..C-1")
    if not classification:
        if y.dtype.kind != "f":
            raise ValueError(f"{where}: {name!r} must be integer class labels or float targets, got dtype {y.dtype}")
        if not np.isfinite(y).all():
            raise ValueError(f"{where}: {name!r} holds NaN or Inf")


def load(name: str, *, clients: int | None = None, dirichlet: float | None = None, seed: int = 0) -> FederatedData:
    """A data set by name (or ``npz:PATH``); ``clients`` and ``dirichlet`` (label-split alpha, 0 = IID) where the
    data set has them; ``seed`` draws its random parts (samples, split) where it has them."""
    if clients is not None:
        clients = check_int(clients, "clients", minimum=1)
    if dirichlet is not None and not (isinstance(dirichlet, (int, float)) and dirichlet >= 0):
        raise ValueError(f"dirichlet must be a number >= 0, got {dirichlet!r}")
    if name.startswith("npz:"):
        kwargs = {k: v for k, v in (("num_clients", clients), ("alpha", dirichlet)) if v is not None}
        return from_npz(name[4:], **kwargs, seed=seed)
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {sorted(DATASETS)}")
    kwargs = {}
    fixed = {"fedexp-linreg": 20, "quadratic": 2}
    if clients is not None:
        if name in fixed:
            if clients != fixed[name]:
                raise ValueError(f"{name} has {fixed[name]} clients; got --clients {clients}")
        else:
            kwargs["num_clients"] = clients
    if dirichlet is not None:
        if name not in ("digits", "digits-noisy"):
            raise ValueError(f"--dirichlet applies to digits and npz data only, not {name}")
        kwargs["alpha"] = dirichlet
    if "seed" in inspect.signature(DATASETS[name]).parameters:
        kwargs["seed"] = seed
    return DATASETS[name](**kwargs)
