"""The demo's data: everything is generated or ships with scikit-learn, nothing is downloaded.

- :func:`make_age_regression`: a stand-in for AFAD-Full (paper Section 5): targets are ages in years,
  two thirds of them in the narrow band 18-30 and the rest spread over 15-75, as in AFAD-Full; the
  features are a fixed random non-linear map of the age plus noise (the "face"). Targets stay in years,
  not standardized, as the paper's regressor predicts the raw age: the squared error is then large and
  unbounded, the regime where the DRO objective is not smooth.
- :func:`load_imbalanced_digits`: scikit-learn's bundled 8x8 digits with the training part of each
  class subsampled by the paper's ratios ``PAPER_RHO`` (Appendix E, imbalanced CIFAR-10); the held-out
  test part keeps every class at full size, as the paper keeps CIFAR-10's test set unchanged.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

# Appendix E: the fraction of each class kept in the imbalanced training set (class 6 is the rarest).
PAPER_RHO = (0.804, 0.543, 0.997, 0.593, 0.390, 0.285, 0.959, 0.806, 0.967, 0.660)


class Split(NamedTuple):
    """A train/test split as float32 feature tensors and targets (float32 ages or int64 labels)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def make_age_regression(n: int = 4000, n_features: int = 16, *, seed: int = 0, test_fraction: float = 0.2) -> Split:
    """Synthetic "age from a face" regression whose targets cluster like AFAD-Full's.

    Ages: two thirds uniform on [18, 30], one third uniform on [15, 75]. Features: a random linear map of
    eight non-linear functions of the age, plus Gaussian noise (so the age is recoverable but not
    linearly), standardized with the training statistics. 80% train / 20% test, as in the paper.
    """
    rng = np.random.default_rng(seed)
    n_band = (2 * n) // 3
    age = np.concatenate([rng.uniform(18.0, 30.0, n_band), rng.uniform(15.0, 75.0, n - n_band)])
    rng.shuffle(age)
    z = (age - 45.0) / 30.0  # about [-1, 1]
    basis = np.stack([z, z**2, z**3, np.sin(3 * z), np.cos(3 * z), np.tanh(4 * z), np.exp(-4 * z**2), np.abs(z)], 1)
    mixing = rng.normal(size=(basis.shape[1], n_features)) / np.sqrt(basis.shape[1])
    features = basis @ mixing + 0.1 * rng.normal(size=(n, n_features))
    n_train = n - int(round(test_fraction * n))
    mean, std = features[:n_train].mean(0), features[:n_train].std(0)
    features = (features - mean) / std
    x = torch.from_numpy(features.astype(np.float32))
    y = torch.from_numpy(age.astype(np.float32))
    return Split(x[:n_train], y[:n_train], x[n_train:], y[n_train:])


def load_imbalanced_digits(*, seed: int = 0, test_fraction: float = 1 / 3, rho=PAPER_RHO) -> Split:
    """scikit-learn's 8x8 digits: a stratified held-out test split, then each training class subsampled.

    Class ``c`` keeps ``round(rho[c] * n_c)`` of its ``n_c`` training images (drawn at random with
    ``seed``); the test split is left balanced. Pixels are scaled to [0, 1] and flattened to 64 features.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        images / 16.0, labels, test_size=test_fraction, stratify=labels, random_state=seed
    )
    rng = np.random.default_rng(seed)
    keep = []
    for c, ratio in enumerate(rho):
        members = np.flatnonzero(y_train == c)
        keep.append(rng.choice(members, size=int(round(ratio * len(members))), replace=False))
    keep = np.sort(np.concatenate(keep))
    as_x = lambda a: torch.from_numpy(a.astype(np.float32))  # noqa: E731
    as_y = lambda a: torch.from_numpy(a.astype(np.int64))  # noqa: E731
    return Split(as_x(x_train[keep]), as_y(y_train[keep]), as_x(x_test), as_y(y_test))
