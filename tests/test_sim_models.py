"""The simulator's batched closed-form gradients equal torch autograd, client by client (float64)."""
from __future__ import annotations

import pytest
import torch

from fastagg.sim.data import FederatedData
from fastagg.sim.models import MLP, LeastSquares, SmallCNN, Softmax


def _data(task):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 9, 6, generator=g, dtype=torch.float64)
    if task == "classification":
        y = torch.randint(0, 5, (4, 9), generator=g)
    else:
        y = torch.randn(4, 9, generator=g, dtype=torch.float64)
    return FederatedData("t", x, y, torch.tensor([9, 5, 7, 1]), task, num_classes=5)


@pytest.mark.parametrize("cls, task", [(LeastSquares, "least_squares"), (Softmax, "classification"),
                                       (MLP, "classification")])
def test_batched_loss_and_gradient_match_autograd(cls, task):
    data = _data(task)
    model = cls(data)
    w = torch.randn(4, model.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 0.3
    mask = (torch.arange(9)[None, :] < data.counts[:, None]).double()
    losses, grads = model.loss_grad(w, data.x, data.y, mask)
    for i in range(4):
        wi = w[i].clone().requires_grad_(True)
        n = int(data.counts[i])
        li, _ = model.loss_grad(wi[None], data.x[i:i + 1, :n], data.y[i:i + 1, :n], torch.ones(1, n, dtype=torch.float64))
        # autograd through the same forward, written independently below
        if cls is LeastSquares:
            ref = 0.5 * (data.x[i, :n] @ wi - data.y[i, :n]).square().sum()
        elif cls is Softmax:
            W, b = wi[: 30].view(6, 5), wi[30:]
            ref = torch.nn.functional.cross_entropy(data.x[i, :n] @ W + b, data.y[i, :n])
        else:
            w1, b1, w2, b2 = torch.split(wi, model.sizes)
            h = torch.relu(data.x[i, :n] @ w1.view(6, 64) + b1)
            ref = torch.nn.functional.cross_entropy(h @ w2.view(64, 5) + b2, data.y[i, :n])
        (gref,) = torch.autograd.grad(ref, wi)
        torch.testing.assert_close(losses[i], ref.detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(li[0].detach(), ref.detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grads[i], gref, rtol=1e-9, atol=1e-12)


def test_cnn_batched_gradients_match_per_client_autograd():
    g = torch.Generator().manual_seed(2)
    data = FederatedData("img", torch.rand(3, 7, 64, generator=g, dtype=torch.float64),
                         torch.randint(0, 10, (3, 7), generator=g), torch.tensor([7, 4, 2]), "classification",
                         num_classes=10)
    model = SmallCNN(data)
    w = model.init(torch.float64, "cpu").expand(3, -1).clone() + 0.01 * torch.randn(3, model.dim, generator=g,
                                                                                    dtype=torch.float64)
    mask = (torch.arange(7)[None, :] < data.counts[:, None]).double()
    losses, grads = model.loss_grad(w, data.x, data.y, mask)
    net = model.module.double()
    for i in range(3):
        n = int(data.counts[i])
        torch.nn.utils.vector_to_parameters(w[i], net.parameters())
        net.zero_grad()
        ref = torch.nn.functional.cross_entropy(net(data.x[i, :n].view(n, 1, 8, 8)), data.y[i, :n])
        ref.backward()
        gref = torch.cat([p.grad.flatten() for p in net.parameters()])
        torch.testing.assert_close(losses[i], ref.detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grads[i], gref, rtol=1e-9, atol=1e-12)
