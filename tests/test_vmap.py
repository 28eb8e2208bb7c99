"""torch.func.vmap over a batch of loss vectors (or logits, hidden states), as docs/design.md section 2.7's matrix
states it for each backend: where it is supported, each row equals the op on that row alone; where not, it raises."""
import pytest
import torch
from torch.func import vmap

import dro_ext
from dro_ext import _backend

B, N, ROWS, CLASSES = 3, 7, 5, 4


def _calls():
    gen = torch.Generator().manual_seed(4)
    losses = torch.rand(B, N, dtype=torch.float64, generator=gen)
    groups = torch.randint(0, 3, (N,), generator=gen)
    logits = torch.randn(B, ROWS, CLASSES, dtype=torch.float64, generator=gen)
    targets = torch.randint(0, CLASSES, (ROWS,), generator=gen)
    hidden = torch.randn(B, ROWS, 3, dtype=torch.float64, generator=gen)
    weight = torch.randn(CLASSES, 3, dtype=torch.float64, generator=gen)
    return {
        "dro_loss": (lambda l: dro_ext.dro_loss(l, 0.1, 0.5, "kl"), losses),
        "dro_weights": (lambda l: dro_ext.dro_weights(l, 0.1, 0.5, "kl"), losses),
        "psi_star": (lambda l: dro_ext.psi_star(l, "kl"), losses),
        "DROLoss": (dro_ext.DROLoss("chi2", 0.5), losses),
        "robust_objective": (lambda l: dro_ext.robust_objective(l, 0.5)[0], losses),
        "worst_case_weights": (lambda l: dro_ext.worst_case_weights(l, 0.5), losses),
        "group_sums": (lambda l: dro_ext.group_sums(l, groups, 3)[0], losses),
        "group_dro_loss": (lambda l: dro_ext.group_dro_loss(l, groups, 3, 0.1, 0.5), losses),
        "DROLoss(num_groups=)": (lambda l: dro_ext.DROLoss(num_groups=3)(l, groups), losses),
        "GroupDROLoss(update=False)": (lambda l: dro_ext.GroupDROLoss(3)(l, groups, False), losses),
        "dro_cross_entropy": (lambda x: dro_ext.dro_cross_entropy(x, targets, 0.1, 0.5), logits),
        "cross_entropy_losses": (lambda x: dro_ext.cross_entropy_losses(x, targets), logits),
        "dro_linear_cross_entropy": (lambda h: dro_ext.dro_linear_cross_entropy(h, weight, targets, 0.1, 0.5),
                                     hidden),
        "linear_cross_entropy_losses": (lambda h: dro_ext.linear_cross_entropy_losses(h, weight, targets), hidden),
    }


# The calls vmap cannot batch, per backend (docs/design.md section 2.7): native ops without a batching rule (the
# Group DRO step mutates its state; the linear cross-entropy's op returns the gradients it formed), and the
# fallback's autograd.Functions without functorch support.
UNBATCHED = {
    "native": {"GroupDROLoss(update=False)", "dro_linear_cross_entropy"},
    "python": {"robust_objective", "worst_case_weights", "dro_cross_entropy", "dro_linear_cross_entropy"},
}


@pytest.mark.parametrize("name", list(_calls()))
def test_vmap_matches_the_matrix(backend, name):
    fn, batch = _calls()[name]
    kind = "native" if _backend.use_native() else "python"
    if name in UNBATCHED[kind]:
        with pytest.raises(RuntimeError, match="Batching rule not implemented|functorch transforms"):
            vmap(fn)(batch)
        return
    got = vmap(fn)(batch)
    want = torch.stack([fn(row) for row in batch])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
