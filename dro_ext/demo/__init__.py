"""The paper's experiments at laptop scale:
``python -m dro_ext.demo [--quick] [--device cpu|cuda] [--seed N] [--out DIR]``.

Meant to be read and copied:

- :mod:`dro_ext.demo.training`: the training loop (``DROLoss`` + ``torch.optim.SGD`` or ``NormalizedSGD``,
  the exact ``Psi`` after every epoch) and the learning-rate search;
- :mod:`dro_ext.demo.experiments`: one function per experiment (Example 3.1, imbalanced regression,
  imbalanced digits with chi2 and with CVaR vs smoothed CVaR);
- :mod:`dro_ext.demo.data`: the data, generated or bundled with scikit-learn (nothing is downloaded);
- :mod:`dro_ext.demo.claims`: the paper's claims (a)-(d) checked against a run's numbers;
- :mod:`dro_ext.demo.report`: the figure, the tables, ``report.md`` and ``results.json``.
"""
