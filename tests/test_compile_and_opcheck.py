"""The native ops against PyTorch's custom-op contract (opcheck), and torch.compile of a training step."""
import pytest
import torch

import dro_ext
import reference as ref
from dro_ext import _backend

native_only = pytest.mark.skipif(not _backend.native_available(), reason="native extension not built")
if not _backend.native_available() and not _backend._force_python:
    raise RuntimeError(f"dro_ext native extension failed to load: {_backend.load_error()}")


@native_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_opcheck_dro_loss(name, params, dtype):
    losses = (1 + torch.randn(65, dtype=torch.float64)).to(dtype).requires_grad_(dtype == torch.float64)
    eta = torch.tensor(0.2, dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                       requires_grad=dtype == torch.float64)
    args = (losses, eta, 0.5, name, params.get("alpha"), params.get("k"), 1.5)
    torch.library.opcheck(torch.ops.dro_ext.dro_loss.default, args)


@native_only
@pytest.mark.parametrize("order", [0, 1, 2])
@pytest.mark.parametrize("name,params", ref.CASES, ids=ref.CASE_IDS)
def test_opcheck_psi_star_terms(name, params, order):
    # psi* has no third derivative here, so at order 2 only the multiplier may require grad.
    differentiable = order < 2
    losses = (1 + torch.randn(33, dtype=torch.float64)).requires_grad_(differentiable)
    eta = torch.tensor(0.2, dtype=torch.float64, requires_grad=differentiable)
    mult = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    args = (losses, eta, mult, 0.5, name, params.get("alpha"), params.get("k"), 1.5, order)
    torch.library.opcheck(torch.ops.dro_ext.psi_star_terms.default, args)


def _training_setup(divergence, params):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    criterion = dro_ext.DROLoss(divergence, lam=0.5, eta_init=0.1, **params)
    x, y = torch.randn(64, 8), torch.randn(64)
    return model, criterion, x, y


def _forward(model, criterion, x, y):
    per_sample = (model(x).squeeze(1) - y) ** 2
    return criterion(per_sample)


@pytest.mark.parametrize("name,params", [("chi2", {}), ("smoothed_cvar", {"alpha": 0.1})], ids=["chi2", "smoothed_cvar"])
def test_compiled_training_step_matches_eager_without_graph_breaks(backend, name, params):
    torch._dynamo.reset()
    model, criterion, x, y = _training_setup(name, params)
    eager_loss = _forward(model, criterion, x, y)
    eager_loss.backward()
    eager_grads = [p.grad.clone() for p in list(model.parameters()) + [criterion.eta]]

    model_c, criterion_c, _, _ = _training_setup(name, params)
    # fullgraph: any graph break is an error. AOTAutograd compiles the backward graph too.
    compiled = torch.compile(_forward, fullgraph=True)
    loss = compiled(model_c, criterion_c, x, y)
    loss.backward()
    grads = [p.grad for p in list(model_c.parameters()) + [criterion_c.eta]]
    torch.testing.assert_close(loss, eager_loss)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e)


def test_compiled_loss_weights_and_psi_star(backend):
    torch._dynamo.reset()

    def fn(losses, eta):
        return (dro_ext.dro_loss(losses, eta, 0.5, "kl_cvar", alpha=0.2),
                dro_ext.dro_weights(losses, eta, 0.5, "kl_cvar", alpha=0.2),
                dro_ext.psi_star(losses, "cressie_read", k=3.0))

    losses, eta = torch.randn(101), torch.tensor(0.3)
    for got, want in zip(torch.compile(fn, fullgraph=True, dynamic=True)(losses, eta), fn(losses, eta)):
        torch.testing.assert_close(got, want)
