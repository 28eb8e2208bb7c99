"""The demo's data: everything is generated or ships with scikit-learn, nothing is downloaded.

- :func:`make_age_regression`: a stand-in for AFAD-Full (paper Section 5): targets are ages in years,
  two thirds of them in the narrow band 18-30 and the rest spread over 15-75, as in AFAD-Full; the
  features are a fixed random non-linear map of the age plus noise (the "face"). Targets stay in years,
  not standardized, as the paper's regressor predicts the raw age: the squared error is then large and
  unbounded, the regime where the DRO objective is not smooth.
- :func:`load_imbalanced_digits`: scikit-learn's bundled 8x8 digits with the training part of each
  class subsampled by the paper's ratios ``PAPER_RHO`` (Appendix E, imbalanced CIFAR-10); the held-out
  test part keeps every class at full size, as the paper keeps CIFAR-10's test set unchanged.
- :func:`load_spurious_digits`: the same digits as a binary task (digit < 5) with a spurious feature, a bright
  bar on the image's left edge, that agrees with the label in 95% of the training images and in half of the
  validation and test images; the groups are (label, bar), as in Sagawa et al.'s Waterbirds and CelebA.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

# Appendix E: the fraction of each class kept in the imbalanced training set (class 6 is the rarest).
PAPER_RHO = (0.804, 0.543, 0.997, 0.593, 0.390, 0.285, 0.959, 0.806, 0.967, 0.660)


# The spurious-correlation task: how often the bar agrees with the label in each split.
TRAIN_AGREEMENT = 0.95
HELD_OUT_AGREEMENT = 0.5
SPURIOUS_GROUPS = 4  # (label, bar) pairs


def present_groups(group_accuracy: Sequence[float]) -> list[float]:
    """The accuracies of the groups with samples: an empty group's is NaN (the mean of nothing), which Python's min
    returned or passed over by where it stood in the list (a split without one of the four groups)."""
    return [a for a in group_accuracy if not math.isnan(a)]


def worst_group(group_accuracy: Sequence[float]) -> float:
    """The lowest accuracy over the groups with samples (NaN where none has any)."""
    present = present_groups(group_accuracy)
    return min(present) if present else float("nan")


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


def load_imbalanced_digits(*, seed: int = 0, test_fraction: float = 1 / 3, rho: Sequence[float] = PAPER_RHO) -> Split:
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
    kept_per_class = []
    for c, ratio in enumerate(rho):
        members = np.flatnonzero(y_train == c)
        kept_per_class.append(rng.choice(members, size=int(round(ratio * len(members))), replace=False))
    keep = np.sort(np.concatenate(kept_per_class))
    as_x = lambda a: torch.from_numpy(a.astype(np.float32))  # noqa: E731
    as_y = lambda a: torch.from_numpy(a.astype(np.int64))  # noqa: E731
    return Split(as_x(x_train[keep]), as_y(y_train[keep]), as_x(x_test), as_y(y_test))


class GroupSplit(NamedTuple):
    """Train/validation/test features (float32), labels (int64) and group ids (int64, ``2 * label + bar``)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    g_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    g_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    g_test: torch.Tensor


def _bar_agreeing(labels: np.ndarray, agreement: float, rng: np.random.Generator) -> np.ndarray:
    """The bar (0 or 1) of each image: equal to its label on exactly ``round(agreement * n)`` of the ``n``
    images of each label, the others drawn at random, so that every split has the agreement it names."""
    bar = labels.copy()
    for label in (0, 1):
        members = np.flatnonzero(labels == label)
        flipped = rng.choice(members, size=len(members) - int(round(agreement * len(members))), replace=False)
        bar[flipped] = 1 - label
    return bar


def load_spurious_digits(*, seed: int = 0, val_fraction: float = 0.2, test_fraction: float = 0.3,
                         train_agreement: float = TRAIN_AGREEMENT,
                         held_out_agreement: float = HELD_OUT_AGREEMENT) -> GroupSplit:
    """scikit-learn's 8x8 digits as "is the digit below 5?", with a spurious feature: a bright bar.

    The label is ``digit < 5`` (1) or not (0). The bar is the image's leftmost column set to full brightness
    (a column the digits almost never ink), present (1) or not (0) per image: it equals the label on
    ``train_agreement`` of each label's training images and on ``held_out_agreement`` of its validation and
    test images, so that a model that reads the bar instead of the digit is right on 95% of the training set
    but on half of the test set. Group ``2 * label + bar``: groups 0 (label 0, no bar) and 3 (label 1, bar)
    are the majority of training, 1 and 2 its minority. The splits are stratified by digit; pixels in [0, 1].
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, digits = load_digits(return_X_y=True)
    images = images / 16.0
    held_out = val_fraction + test_fraction
    x_train, x_rest, d_train, d_rest = train_test_split(images, digits, test_size=held_out, stratify=digits,
                                                        random_state=seed)
    x_val, x_test, d_val, d_test = train_test_split(x_rest, d_rest, test_size=test_fraction / held_out,
                                                    stratify=d_rest, random_state=seed)
    rng = np.random.default_rng(seed)
    tensors = []
    for x, digit, agreement in ((x_train, d_train, train_agreement), (x_val, d_val, held_out_agreement),
                                (x_test, d_test, held_out_agreement)):
        label = (digit < 5).astype(np.int64)
        bar = _bar_agreeing(label, agreement, rng)
        x = x.reshape(-1, 8, 8).copy()
        x[bar == 1, :, 0] = 1.0
        tensors += [torch.from_numpy(x.reshape(-1, 64).astype(np.float32)), torch.from_numpy(label),
                    torch.from_numpy(2 * label + bar)]
    return GroupSplit(*tensors)
