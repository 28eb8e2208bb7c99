"""The paper's experiments at laptop scale: ``python -m dro_ext.demo [--quick] [--device cpu|cuda] [--seed N] [--out DIR]``."""
