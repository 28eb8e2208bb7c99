"""DRO training with PyTorch Lightning: the demo's imbalanced-digits classifier under the chi2 DRO objective.

    python examples/lightning_classifier.py [--epochs 5] [--divergence chi2] [--lam 0.5]

A LightningModule owns the model and ``DROLoss`` (whose dual variable ``eta`` is a parameter, so it is in
``self.parameters()``), returns the DRO objective of the per-sample cross-entropies from ``training_step``, and
hands every parameter, ``eta`` included, to ``NormalizedSGD`` in ``configure_optimizers``. The data is
scikit-learn's 8x8 digits with most of the training images of some classes removed (``dro_ext.demo.data``); the
test split stays balanced, and the worst class's test accuracy is what DRO should raise.

Needs ``pip install "dro_ext[examples,demo]"`` (lightning, scikit-learn).
"""
from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F

import dro_ext
from dro_ext.demo.data import load_imbalanced_digits
from dro_ext.demo.experiments import small_mlp


class DROClassifier(L.LightningModule):
    def __init__(self, divergence: str = "chi2", lam: float = 0.5, lr: float = 0.05, momentum: float = 0.9):
        super().__init__()
        self.save_hyperparameters()
        self.model = small_mlp(64, 10)
        self.dro_loss = dro_ext.DROLoss(divergence, lam)  # eta: a parameter of this module

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.dro_loss(F.cross_entropy(self(x), y, reduction="none"))
        self.log_dict({"dro_objective": loss, "eta": self.dro_loss.eta.detach()}, on_step=True)
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        correct = (self(x).argmax(1) == y).float()
        per_class = torch.zeros(10, device=x.device).index_add_(0, y, correct)
        counts = torch.zeros(10, device=x.device).index_add_(0, y, torch.ones_like(correct))
        self.log_dict({"test_accuracy": correct.mean(), "worst_class_accuracy": (per_class / counts).min()})

    def configure_optimizers(self):
        # Every parameter, eta included: the paper's Algorithm 1 moves (model, eta) jointly.
        return dro_ext.NormalizedSGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


def loaders(batch_size: int = 64, seed: int = 0):
    split = load_imbalanced_digits(seed=seed)
    train = torch.utils.data.TensorDataset(split.x_train, split.y_train)
    test = torch.utils.data.TensorDataset(split.x_test, split.y_test)
    gen = torch.Generator().manual_seed(seed)
    return (torch.utils.data.DataLoader(train, batch_size=batch_size, shuffle=True, generator=gen),
            torch.utils.data.DataLoader(test, batch_size=len(test)))


def train(epochs: int = 5, divergence: str = "chi2", lam: float = 0.5, max_steps: int = -1, seed: int = 0):
    """Trains and tests; returns (module, trainer, the test metrics)."""
    L.seed_everything(seed, verbose=False)
    module = DROClassifier(divergence, lam)
    trainer = L.Trainer(max_epochs=epochs, max_steps=max_steps, accelerator="auto", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=1)
    train_loader, test_loader = loaders(seed=seed)
    trainer.fit(module, train_loader)
    (metrics,) = trainer.test(module, test_loader, verbose=False)
    return module, trainer, metrics


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--divergence", default="chi2", choices=dro_ext.DIVERGENCES)
    parser.add_argument("--lam", type=float, default=0.5)
    args = parser.parse_args(argv)
    module, _, metrics = train(args.epochs, args.divergence, args.lam)
    print(f"test accuracy {metrics['test_accuracy']:.3f}, worst class {metrics['worst_class_accuracy']:.3f}, "
          f"eta {module.dro_loss.eta.item():.3f}")


if __name__ == "__main__":
    main()
