"""Batched models: M clients' parameters are rows of one ``[M, d]`` tensor; one call gives every client's
mini-batch mean loss and gradient (closed forms with batched matrix products, no Python loop over clients).
"""
from __future__ import annotations

import importlib
import inspect
import math
import os
import sys

import torch

from .data import FederatedData


class Model:
    """``dim`` parameters per client; ``loss_grad(w [M, d], x [M, B, f], y [M, B], mask [M, B])`` returns the
    per-client losses [M] and gradients [M, d]; ``loss(w [d], data)`` the global training loss the paper reports.
    Classifiers evaluate in chunks of ``eval_chunk`` samples (:func:`chunked_metrics`), so memory stays bounded
    whatever the data set's size."""

    dim: int
    eval_chunk: int = 1 << 16


def chunked_metrics(metrics, w, x, y, chunk: int):
    """``metrics(w, x, y) -> (mean loss, accuracy)`` over ``x`` in chunks of ``chunk`` rows, combined by size in
    float64 (one call when ``x`` fits one chunk: the same numbers as before chunking)."""
    if len(x) <= chunk:
        return metrics(w, x, y)
    loss = torch.zeros((), dtype=torch.float64, device=x.device)
    acc = torch.zeros((), dtype=torch.float64, device=x.device)
    for start in range(0, len(x), chunk):
        xc, yc = x[start:start + chunk], y[start:start + chunk]
        part_loss, part_acc = metrics(w, xc, yc)
        loss += part_loss.double() * len(xc)
        acc += part_acc.double() * len(xc)
    return (loss / len(x)).to(w.dtype), (acc / len(x)).to(w.dtype)


class LeastSquares(Model):
    """FedExP's linear regression: client objective (1/2)||A w - b||^2 with gradient A^T (A w - b) (sums over the
    client's samples, the paper's convention); reported ``F(w) = mean_i ||A_i w - b_i||^2`` (so ``F(0) = 1``).

    Full-batch local gradient descent runs in the samples' space (``local_gd``), and the data are read once per
    evaluation of several models (``losses``); the residual of the last model evaluated is kept, so the next round
    starting from it does not read the data again. A pass over FedExP's regression data (20 x 30 x 1000 float64,
    4.8 MB) takes ~0.18 ms on one core here: a round reads it twice instead of 2 + 2 x 20 times."""

    def __init__(self, data: FederatedData):
        self.dim = data.num_features
        self.data = data
        mask = _mask(data)
        self._a, self._b = data.x * mask.unsqueeze(2), data.y * mask  # padding rows zeroed once
        self._gram = None
        self._poly = {}
        self._last = None  # (model, its residuals [N, n]) of the last model ``losses`` evaluated

    def loss_grad(self, w, x, y, mask):
        r = (torch.bmm(x, w.unsqueeze(2)).squeeze(2) - y) * mask
        return 0.5 * r.square().sum(1), torch.bmm(x.transpose(1, 2), r.unsqueeze(2)).squeeze(2)

    @torch.no_grad()
    def test_metrics(self, w, x, y):
        """(mean squared error on a held-out set, NaN: no accuracy for regression)."""
        return (x @ w - y).square().mean(), torch.tensor(float("nan"))

    def max_stable_lr(self, batch_size: int) -> float:
        """The local lr above which a gradient step ``w <- w - lr A^T (A w - b)`` expands the error: 2 / the largest
        curvature. Full batch: the largest eigenvalue of any client's A_i^T A_i. Minibatches: the largest squared
        sample norm (every batch holding that sample has at least that curvature)."""
        if batch_size == 0:
            curvature = float(torch.linalg.matrix_norm(self._a, ord=2).max()) ** 2
        else:
            curvature = float(self._a.square().sum(2).max())
        return 2.0 / curvature if curvature > 0 else math.inf

    def _residuals(self, ws):
        """``A_i w - b_i`` for every client and every row of ``ws`` [k, d]: [N, n, k], one read of A."""
        n_clients, n, d = self._a.shape
        return (self._a.view(n_clients * n, d) @ ws.T).view(n_clients, n, -1) - self._b.unsqueeze(2)

    def local_gd(self, w0, ids, steps: int, lr: float):
        """``steps`` full-batch gradient steps of every client ``ids`` from ``w0``, in the samples' space.

        With ``r = A w - b``, a step ``w <- w - lr A^T r`` moves the residual by ``r <- (I - lr G) r`` with the
        n x n Gram matrix ``G = A A^T``, so ``w_K = w0 - lr A^T P r_0`` with ``P = sum_{k<K} (I - lr G)^k``: one
        product with A^T per round (``r_0`` too when ``w0`` is not the model last evaluated), P computed once per
        (lr, K). The same iterates as K steps on w up to rounding (``test_sim.py`` compares the two paths)."""
        a = self._a
        if self._gram is None:  # A A^T, once per data set
            self._gram = torch.bmm(a, a.transpose(1, 2))  # [N, n, n]
        if (steps, lr) not in self._poly:
            g = self._gram
            eye = torch.eye(g.shape[1], dtype=g.dtype, device=g.device).expand_as(g)
            step = eye - lr * g
            poly = eye.clone()
            for _ in range(steps - 1):  # Horner: P = I + M (I + M (I + ...))
                poly = eye + torch.bmm(step, poly)
            self._poly = {(steps, lr): poly}  # one entry: a decaying lr changes it every round
        poly = self._poly[steps, lr]
        if self._last is not None and torch.equal(self._last[0], w0):
            r0 = self._last[1]
        else:
            r0 = self._residuals(w0.unsqueeze(0))[..., 0]
        if len(ids) != len(a) or not bool((ids == torch.arange(len(a), device=ids.device)).all()):
            a, r0, poly = a[ids], r0[ids], poly[ids]  # partial participation: the round's clients
        total = torch.bmm(r0.unsqueeze(1), poly.transpose(1, 2))  # (P r0)^T: [M, 1, n]
        return w0 - lr * torch.bmm(total, a).squeeze(1)  # row-vector times A: ~1.7x faster than A^T times a column

    def losses(self, ws, data):
        """``loss`` of each row of ``ws`` [k, d] (one read of the data); the last row's residuals are kept."""
        if data is not self.data:
            return torch.stack([self.loss(w, data) for w in ws])
        r = self._residuals(ws)
        self._last = (ws[-1].clone(), r[..., -1].clone())
        return r.square().sum(1).mean(0)

    def loss(self, w, data):
        return self.losses(w.unsqueeze(0), data)[0]


class Quadratic(Model):
    """Paper 003's f_i(x) = (a_i / 2) x^2 (a_i stored as the client's only feature)."""

    def __init__(self, data: FederatedData):
        self.dim = 1

    def init(self, dtype, device) -> torch.Tensor:
        """x0 = 1 (the minimizer is 0)."""
        return torch.ones(1, dtype=dtype, device=device)

    def loss_grad(self, w, x, y, mask):
        a = x[:, 0, 0]
        return 0.5 * a * w[:, 0].square(), (a * w[:, 0]).unsqueeze(1)

    def loss(self, w, data):
        return (0.5 * data.x[:, 0, 0] * w[0] ** 2).mean()


class Softmax(Model):
    """Multinomial logistic regression: W [f, C] and b [C] flattened; mean cross-entropy over the batch."""

    def __init__(self, data: FederatedData):
        self.f, self.c = data.num_features, data.num_classes
        self.dim = (self.f + 1) * self.c

    def _split(self, w):
        return w[..., : self.f * self.c].unflatten(-1, (self.f, self.c)), w[..., self.f * self.c:]

    def loss_grad(self, w, x, y, mask):
        W, b = self._split(w)
        logits = torch.bmm(x, W) + b.unsqueeze(1)
        logp = torch.log_softmax(logits, dim=2)
        n = mask.sum(1).clamp_min(1)
        nll = -(logp.gather(2, y.unsqueeze(2)).squeeze(2) * mask).sum(1) / n
        err = (logp.exp() - torch.nn.functional.one_hot(y, self.c).to(w.dtype)) * (mask / n.unsqueeze(1)).unsqueeze(2)
        gW = torch.bmm(x.transpose(1, 2), err)
        return nll, torch.cat([gW.flatten(1), err.sum(1)], dim=1)

    def loss(self, w, data):
        return self.test_metrics(w, *data.samples())[0]

    def accuracy(self, w, data):
        return self.test_metrics(w, *data.samples())[1]

    def test_metrics(self, w, x, y):
        return chunked_metrics(self._metrics, w, x, y, self.eval_chunk)

    def _metrics(self, w, x, y):
        W, b = self._split(w)
        logp = torch.log_softmax(x @ W + b, dim=1)
        return -logp.gather(1, y.unsqueeze(1)).mean(), (logp.argmax(1) == y).to(w.dtype).mean()


class MLP(Model):
    """One hidden ReLU layer (``hidden`` units) and a softmax output; mean cross-entropy over the batch. Forward and
    backward are written out with batched matrix products (every client's MLP at once)."""

    def __init__(self, data: FederatedData, hidden: int = 64, seed: int = 0):
        self.f, self.h, self.c = data.num_features, hidden, data.num_classes
        self.sizes = [self.f * self.h, self.h, self.h * self.c, self.c]
        self.dim = sum(self.sizes)
        self.seed = seed

    def init(self, dtype, device) -> torch.Tensor:
        """He-style initial weights (zeros would leave the hidden units identical)."""
        g = torch.Generator().manual_seed(self.seed)
        w1 = torch.randn(self.f, self.h, generator=g, dtype=torch.float64) * (2.0 / self.f) ** 0.5
        w2 = torch.randn(self.h, self.c, generator=g, dtype=torch.float64) * (1.0 / self.h) ** 0.5
        flat = torch.cat([w1.flatten(), torch.zeros(self.h, dtype=torch.float64), w2.flatten(),
                          torch.zeros(self.c, dtype=torch.float64)])
        return flat.to(device, dtype)

    def _split(self, w):
        w1, b1, w2, b2 = torch.split(w, self.sizes, dim=-1)
        return (w1.unflatten(-1, (self.f, self.h)), b1, w2.unflatten(-1, (self.h, self.c)), b2)

    def _forward(self, w, x):
        w1, b1, w2, b2 = self._split(w)
        pre = x @ w1 + b1.unsqueeze(-2)  # batched over clients when w is [M, d], broadcast when it is [d]
        hid = torch.relu(pre)
        return pre, hid, hid @ w2 + b2.unsqueeze(-2)

    def loss_grad(self, w, x, y, mask):
        _, b1, w2, _ = self._split(w)
        pre, hid, logits = self._forward(w, x)
        logp = torch.log_softmax(logits, dim=2)
        n = mask.sum(1).clamp_min(1)
        nll = -(logp.gather(2, y.unsqueeze(2)).squeeze(2) * mask).sum(1) / n
        err = (logp.exp() - torch.nn.functional.one_hot(y, self.c).to(w.dtype)) * (mask / n.unsqueeze(1)).unsqueeze(2)
        g_w2 = torch.bmm(hid.transpose(1, 2), err)
        back = torch.bmm(err, w2.transpose(1, 2)) * (pre > 0).to(w.dtype)
        g_w1 = torch.bmm(x.transpose(1, 2), back)
        return nll, torch.cat([g_w1.flatten(1), back.sum(1), g_w2.flatten(1), err.sum(1)], dim=1)

    def _logp(self, w, x):
        return torch.log_softmax(self._forward(w, x)[2], dim=-1)

    def loss(self, w, data):
        return self.test_metrics(w, *data.samples())[0]

    def accuracy(self, w, data):
        return self.test_metrics(w, *data.samples())[1]

    def test_metrics(self, w, x, y):
        return chunked_metrics(self._metrics, w, x, y, self.eval_chunk)

    def _metrics(self, w, x, y):
        logp = self._logp(w, x)
        return -logp.gather(1, y.unsqueeze(1)).mean(), (logp.argmax(1) == y).to(w.dtype).mean()


class Functional(Model):
    """Any ``nn.Module`` classifier as a batched model: ``torch.func.vmap`` over ``functional_call`` and
    ``grad_and_value`` gives every client's mean cross-entropy and gradient in one call (one flat row per client)."""

    def __init__(self, data: FederatedData, module: torch.nn.Module, input_shape: tuple):
        self.module, self.input_shape, self.c = module, input_shape, data.num_classes
        params = dict(module.named_parameters())
        self.names = list(params)
        self.shapes = [p.shape for p in params.values()]
        self.sizes = [p.numel() for p in params.values()]
        self.dim = sum(self.sizes)
        # activations of a convolution take far more memory than its input: evaluate ~256 samples at a time
        self.eval_chunk = 256
        # dropout draws its own mask per client in training; evaluation runs the module in eval mode
        self.randomness = "different" if any(isinstance(m, torch.nn.Dropout) for m in module.modules()) else "error"

    def init(self, dtype, device) -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in self.module.parameters()]).to(device, dtype)

    def _params(self, w):
        return {n: t.view(s) for n, t, s in zip(self.names, torch.split(w, self.sizes), self.shapes)}

    def _logits(self, w, x):
        return torch.func.functional_call(self.module, self._params(w), (x.reshape(-1, *self.input_shape),))

    def _client_loss(self, w, x, y, mask):
        ce = torch.nn.functional.cross_entropy(self._logits(w, x), y, reduction="none")
        return (ce * mask).sum() / mask.sum().clamp_min(1)

    def loss_grad(self, w, x, y, mask):
        self.module.to(w.dtype).train()
        grads, losses = torch.func.vmap(torch.func.grad_and_value(self._client_loss),
                                        randomness=self.randomness)(w, x, y, mask)
        return losses.detach(), grads.detach()

    def loss(self, w, data):
        return self.test_metrics(w, *data.samples())[0]

    def accuracy(self, w, data):
        return self.test_metrics(w, *data.samples())[1]

    @torch.no_grad()
    def test_metrics(self, w, x, y):
        self.module.to(w.dtype).eval()
        return chunked_metrics(self._metrics, w, x, y, self.eval_chunk)

    def _metrics(self, w, x, y):
        logits = self._logits(w, x)
        return torch.nn.functional.cross_entropy(logits, y), (logits.argmax(1) == y).to(w.dtype).mean()


def SmallCNN(data: FederatedData, seed: int = 0) -> Functional:
    """conv 3x3 (8 channels) - ReLU - max-pool 2 - linear, for square images of one channel (digits: 8x8) or three
    (channels first: CIFAR-shaped 32x32x3)."""
    channels = next((c for c in (1, 3) if data.num_features % c == 0 and
                     round((data.num_features // c) ** 0.5) ** 2 == data.num_features // c), None)
    if channels is None:
        raise ValueError(f"model 'cnn' needs square images of 1 or 3 channels; {data.name} has {data.num_features} "
                         "features")
    side = round((data.num_features // channels) ** 0.5)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Conv2d(channels, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                              torch.nn.Flatten(), torch.nn.Linear(8 * (side // 2) ** 2, data.num_classes))
    return Functional(data, net, (channels, side, side))


def pfl_cnn_module(in_channels: int = 3, side: int = 32, num_classes: int = 10, seed: int = 0) -> torch.nn.Module:
    """pfl-research's ``simple_cnn`` (benchmarks/model/pytorch/cnn.py) for channels-first images: conv 3x3 (32) -
    ReLU - conv 3x3 (64) - ReLU - max-pool 2 - dropout 0.25 - linear 128 - ReLU - dropout 0.5 - linear, Glorot
    uniform weights (1.63 M parameters at 32x32x3)."""
    torch.manual_seed(seed)
    flat = ((side - 4) // 2) ** 2 * 64
    net = torch.nn.Sequential(torch.nn.Conv2d(in_channels, 32, 3), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3),
                              torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Dropout(0.25), torch.nn.Flatten(),
                              torch.nn.Linear(flat, 128), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                              torch.nn.Linear(128, num_classes))
    for m in net.modules():
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
            torch.nn.init.xavier_uniform_(m.weight)
    return net


def PflCNN(data: FederatedData, seed: int = 0) -> Functional:
    """pfl-research's CIFAR-10 benchmark CNN (``pfl_cnn_module``) on 3-channel square images."""
    side = int(round((data.num_features / 3) ** 0.5))
    if 3 * side * side != data.num_features:
        raise ValueError(f"model 'pfl-cnn' needs square 3-channel images; {data.name} has {data.num_features} features")
    return Functional(data, pfl_cnn_module(3, side, data.num_classes, seed), (3, side, side))


def _mask(data: FederatedData) -> torch.Tensor:
    n = data.x.shape[1]
    return (torch.arange(n, device=data.x.device)[None, :] < data.counts[:, None]).to(data.x.dtype)


MODELS = {"linear": LeastSquares, "quadratic": Quadratic, "softmax": Softmax, "mlp": MLP, "cnn": SmallCNN,
          "pfl-cnn": PflCNN}
SEEDED = ("mlp", "cnn", "pfl-cnn")  # random initial weights; the others start from zeros (or x0 = 1)


# models registered from Python (register_model) and the factories of "package.module:factory" names, by name
_USER_MODELS: dict = {}


def register_model(name: str, factory) -> None:
    """Make ``--model NAME`` / ``Config(model=NAME)`` build ``factory(data)`` (or ``factory()``, for a factory
    that takes no argument): a classifier ``nn.Module`` taking ``data.num_features`` flat features (or a
    ``(module, input_shape)`` pair: each sample is reshaped to ``input_shape``, channels first), or a
    :class:`Model`. The factory is called with torch's generator seeded with the run's seed (0 under
    ``seed_scope="sampling"``), so every algorithm of a seed starts from the same model. Per-client BatchNorm
    statistics cannot be kept by a batched client step: a BatchNorm that tracks running statistics is refused
    (naming the layer); ``track_running_stats=False``, GroupNorm or LayerNorm work. A name registered here is
    recorded in config.json like any other; ``--resume`` from the command line needs it as
    ``package.module:factory``, named again with ``--model`` (a folder's config.json alone never imports code)."""
    if not isinstance(name, str) or not name or ":" in name or name in MODELS:
        raise ValueError(f"model name {name!r}: a non-empty name without ':' that is not built in ({sorted(MODELS)})")
    if not callable(factory):
        raise TypeError(f"register_model({name!r}, ...): the factory must be callable (data -> nn.Module)")
    _USER_MODELS[name] = factory


def imports_code(name) -> bool:
    """Whether building the model ``name`` imports a module named by it (``package.module:factory``, not built in
    and not registered in this process)."""
    return isinstance(name, str) and ":" in name and name not in _USER_MODELS


def _call_factory(factory, data: FederatedData):
    """``factory(data)``, or ``factory()`` for a factory that takes no argument (``def net(): return MyNet()``,
    what one writes first): its signature decides."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: the documented call
        return factory(data)
    takes_one = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)
    return factory(data) if takes_one else factory()


def _factory(name: str):
    """The factory of a registered name or of ``package.module:factory`` (imported, the current directory first on
    the import path, as ``python -m`` has it)."""
    if name in _USER_MODELS:
        return _USER_MODELS[name]
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ValueError(f"model {name!r}: expected package.module:factory")
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module's own error at import: one line
        raise ValueError(f"model {name!r}: cannot import {module_name!r} ({type(e).__name__}: {e})") from None
    finally:
        if added:
            sys.path.remove(os.getcwd())
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"model {name!r}: {module_name} has no callable {attr!r}")
    return factory


def _user_model(name: str, data: FederatedData, seed: int = 0) -> Model:
    if data.task != "classification":
        raise ValueError(f"model {name!r}: your own models are classifiers; {data.name} is {data.task}")
    factory = _factory(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            built = _call_factory(factory, data)
        except Exception as e:  # the user's code: one line naming it, before any work
            raise ValueError(f"model {name!r}: the factory raised {type(e).__name__}: {str(e)[:200]}") from None
    if isinstance(built, Model):
        return built
    module, shape = built if isinstance(built, tuple) and len(built) == 2 else (built, (data.num_features,))
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"model {name!r}: the factory returned {type(module).__name__}; expected an nn.Module, "
                         "a (module, input_shape) pair or a fastagg.sim.models.Model")
    shape = tuple(int(v) for v in shape)
    if math.prod(shape) != data.num_features:
        raise ValueError(f"model {name!r}: input_shape {shape} holds {math.prod(shape)} values; {data.name} has "
                         f"{data.num_features} features")
    for layer, m in module.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            raise ValueError(f"model {name!r}: layer {layer!r} ({type(m).__name__}) keeps running statistics, "
                             "which a batched step of many clients cannot keep per client; build it with "
                             "track_running_stats=False, or use GroupNorm / LayerNorm")
    try:  # two zero samples through it, before any work: a module that does not fit the data fails here
        with torch.no_grad():
            out = module.to(data.x.dtype).eval()(torch.zeros(2, *shape, dtype=data.x.dtype))
    except Exception as e:
        raise ValueError(f"model {name!r}: a batch of input_shape {shape} fails in it ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, data.num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"model {name!r}: it returns {got} for 2 samples; expected (2, {data.num_classes}) logits")
    return Functional(data, module, shape)


def make(name: str, data: FederatedData, seed: int = 0) -> Model:
    """The model called ``name`` for ``data``: built in (``MODELS``), registered (:func:`register_model`), or
    ``package.module:factory``; ``seed`` draws its initial weights (models that start from zeros ignore it)."""
    if name in _USER_MODELS or (isinstance(name, str) and ":" in name):
        return _user_model(name, data, seed)
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}, one registered with "
                         "fastagg.sim.register_model, or package.module:factory")
    if data.task == "quadratic" or name == "quadratic":
        if data.task != "quadratic" or name != "quadratic":
            raise ValueError(f"model 'quadratic' goes with the quadratic data set only; {data.name} / {name!r}")
        return Quadratic(data)
    if name in ("softmax", "mlp", "cnn", "pfl-cnn") and data.task != "classification":
        raise ValueError(f"model {name!r} needs a classification dataset; {data.name} is {data.task}")
    if name == "linear" and data.task != "least_squares":
        raise ValueError(f"model 'linear' is least squares; {data.name} is {data.task} (use --model softmax)")
    return MODELS[name](data, seed=seed) if name in SEEDED else MODELS[name](data)
