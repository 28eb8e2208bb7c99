"""DROLoss: the penalized DRO objective as an nn.Module that owns its dual variable eta."""
from __future__ import annotations

import torch
from torch import nn

from dro_ext._divergences import check_divergence, check_positive
from dro_ext.ops import dro_loss


class DROLoss(nn.Module):
    """``forward(losses) = mean_i lam * psi*((l_i - scale*eta)/lam) + scale*eta``.

    ``eta`` is a 0-d ``nn.Parameter``: put the module's parameters in the optimizer beside the model's,
    and minimizing the loss jointly over both minimizes the DRO objective (paper eq. 2.1). ``scale`` is
    the paper's G (Theorem 2.2's rescaling of eta).
    """

    def __init__(self, divergence="chi2", lam=0.1, *, alpha=None, k=None, scale=1.0, eta_init=0.0):
        super().__init__()
        spec = check_divergence(divergence, alpha, k)
        self.divergence, self.alpha, self.k = spec
        self.lam = check_positive("lam", lam)
        self.scale = check_positive("scale", scale)
        self.eta = nn.Parameter(torch.tensor(float(eta_init)))

    def forward(self, losses: torch.Tensor) -> torch.Tensor:
        return dro_loss(losses, self.eta, self.lam, self.divergence, alpha=self.alpha, k=self.k, scale=self.scale)

    def extra_repr(self) -> str:
        params = "".join(f", {n}={v}" for n, v in (("alpha", self.alpha), ("k", self.k)) if v is not None)
        return f"divergence={self.divergence!r}, lam={self.lam}{params}, scale={self.scale}"
