"""dro_ext: fused distributionally robust optimization (DRO) losses and optimizers for PyTorch.

Implements the penalized psi-divergence DRO objective and the mini-batch normalized SGD with momentum
of Jin et al., "Non-convex Distributionally Robust Optimization: Non-asymptotic Analysis" (NeurIPS 2021)
as fused C++ (and CUDA) kernels exposed as torch custom ops, with a pure-PyTorch fallback.
"""
from dro_ext._backend import backend
from dro_ext._divergences import Divergence
from dro_ext.cross_entropy import (
    DROCrossEntropyLoss, DROLinearCrossEntropyLoss, dro_cross_entropy, dro_linear_cross_entropy,
)
from dro_ext.cross_entropy_groups import cross_entropy_losses, linear_cross_entropy_losses
from dro_ext.group_evaluation import GroupEvaluation
from dro_ext.group_reduction import group_sums
from dro_ext.groups import GroupDROLoss, group_dro_loss
from dro_ext.loss import DROLoss
from dro_ext.ops import DIVERGENCES, dro_loss, dro_weights, psi_star
from dro_ext.optim import NormalizedSGD
from dro_ext.robust import evaluate, robust_objective, weight_stats, worst_case_weights

__all__ = [
    "DIVERGENCES", "DROCrossEntropyLoss", "DROLinearCrossEntropyLoss", "DROLoss", "Divergence", "GroupDROLoss",
    "GroupEvaluation", "NormalizedSGD", "backend", "cross_entropy_losses", "dro_cross_entropy",
    "dro_linear_cross_entropy", "dro_loss", "dro_weights", "evaluate", "group_dro_loss", "group_sums",
    "linear_cross_entropy_losses", "psi_star", "robust_objective", "weight_stats", "worst_case_weights",
]
__version__ = "0.1.0"
