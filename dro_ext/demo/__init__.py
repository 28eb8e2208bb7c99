"""The paper's experiments at laptop scale, and one beyond it:
``python -m dro_ext.demo [--quick] [--device cpu|cuda] [--seed N] [--out DIR] [--experiments NAME ...]``.

Meant to be read and copied:

- :mod:`dro_ext.demo.training`: the training loop (``DROLoss`` + ``torch.optim.SGD`` or ``NormalizedSGD``,
  the exact ``Psi`` after every epoch) and the learning-rate search;
- :mod:`dro_ext.demo.experiments`: one function per experiment (Example 3.1, imbalanced regression,
  imbalanced digits with chi2 and with CVaR vs smoothed CVaR; beyond the paper, digits with a spurious feature:
  ERM vs ``GroupDROLoss`` vs chi2 ``DROLoss`` over groups and over samples, with its own short training loop,
  :func:`~dro_ext.demo.experiments.train_with_groups`);
- :mod:`dro_ext.demo.data`: the data, generated or bundled with scikit-learn (nothing is downloaded);
- :mod:`dro_ext.demo.claims`: the paper's claims (a)-(d), and (e)-(f) beyond it, checked against a run's numbers;
- :mod:`dro_ext.demo.report`: the figure, the tables, ``report.md`` and ``results.json``.
"""
import importlib.util

# What the demo needs beyond dro_ext's own dependencies (pyproject.toml's "demo" extra): checked here, on the
# package's import, so that `python -m dro_ext.demo` without them fails with one message instead of the first
# ImportError deep in a module.
DEMO_REQUIREMENTS = {"sklearn": "scikit-learn", "matplotlib": "matplotlib", "tqdm": "tqdm"}

_missing = [package for module, package in DEMO_REQUIREMENTS.items() if importlib.util.find_spec(module) is None]
if _missing:
    raise ModuleNotFoundError(f"dro_ext.demo needs {', '.join(_missing)}, which are not installed: "
                              f'pip install "dro_ext[demo]"')
