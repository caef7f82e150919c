"""Batched models: M clients' parameters are rows of one ``[M, d]`` tensor; one call gives every client's
mini-batch mean loss and gradient (closed forms with batched matrix products, no Python loop over clients).
"""
from __future__ import annotations

import torch

from .data import FederatedData


class Model:
    """``dim`` parameters per client; ``loss_grad(w [M, d], x [M, B, f], y [M, B], mask [M, B])`` returns the
    per-client losses [M] and gradients [M, d]; ``loss(w [d], data)`` the global training loss the paper reports."""

    dim: int


class LeastSquares(Model):
    """FedExP's linear regression: client objective (1/2)||A w - b||^2 with gradient A^T (A w - b) (sums over the
    client's samples, the paper's convention); reported ``F(w) = mean_i ||A_i w - b_i||^2`` (so ``F(0) = 1``)."""

    def __init__(self, data: FederatedData):
        self.dim = data.num_features

    def loss_grad(self, w, x, y, mask):
        r = (torch.bmm(x, w.unsqueeze(2)).squeeze(2) - y) * mask
        return 0.5 * r.square().sum(1), torch.bmm(x.transpose(1, 2), r.unsqueeze(2)).squeeze(2)

    def loss(self, w, data):
        r = (data.x @ w - data.y) * _mask(data)
        return r.square().sum(1).mean()


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
        W, b = self._split(w)
        logp = torch.log_softmax(data.x @ W + b, dim=2)
        mask = _mask(data)
        nll = -(logp.gather(2, data.y.unsqueeze(2)).squeeze(2) * mask).sum() / mask.sum()
        return nll

    def accuracy(self, w, data):
        W, b = self._split(w)
        pred = (data.x @ W + b).argmax(2)
        mask = _mask(data)
        return ((pred == data.y).to(w.dtype) * mask).sum() / mask.sum()

    def test_metrics(self, w, x, y):
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
        logp = self._logp(w, data.x)
        mask = _mask(data)
        return -(logp.gather(2, data.y.unsqueeze(2)).squeeze(2) * mask).sum() / mask.sum()

    def accuracy(self, w, data):
        pred = self._logp(w, data.x).argmax(2)
        mask = _mask(data)
        return ((pred == data.y).to(w.dtype) * mask).sum() / mask.sum()

    def test_metrics(self, w, x, y):
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

    def _all(self, w, data):
        self.module.to(w.dtype).eval()
        keep = _mask(data).bool()
        return self._logits(w, data.x[keep]), data.y[keep]

    @torch.no_grad()
    def loss(self, w, data):
        logits, y = self._all(w, data)
        return torch.nn.functional.cross_entropy(logits, y)

    @torch.no_grad()
    def accuracy(self, w, data):
        logits, y = self._all(w, data)
        return (logits.argmax(1) == y).to(w.dtype).mean()

    @torch.no_grad()
    def test_metrics(self, w, x, y):
        self.module.to(w.dtype).eval()
        logits = self._logits(w, x)
        return torch.nn.functional.cross_entropy(logits, y), (logits.argmax(1) == y).to(w.dtype).mean()


def SmallCNN(data: FederatedData, seed: int = 0) -> Functional:
    """conv 3x3 (8 channels) - ReLU - max-pool 2 - linear, for square single-channel images (digits: 8x8)."""
    side = int(round(data.num_features ** 0.5))
    if side * side != data.num_features:
        raise ValueError(f"model 'cnn' needs square single-channel images; {data.name} has {data.num_features} features")
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                              torch.nn.Flatten(), torch.nn.Linear(8 * (side // 2) ** 2, data.num_classes))
    return Functional(data, net, (1, side, side))


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


def make(name: str, data: FederatedData) -> Model:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    if data.task == "quadratic" or name == "quadratic":
        if data.task != "quadratic" or name != "quadratic":
            raise ValueError(f"model 'quadratic' goes with the quadratic data set only; {data.name} / {name!r}")
        return Quadratic(data)
    if name in ("softmax", "mlp", "cnn", "pfl-cnn") and data.task != "classification":
        raise ValueError(f"model {name!r} needs a classification dataset; {data.name} is {data.task}")
    if name == "linear" and data.task != "least_squares":
        raise ValueError(f"model 'linear' is least squares; {data.name} is {data.task} (use --model softmax)")
    return MODELS[name](data)
