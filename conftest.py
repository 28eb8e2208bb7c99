# Makes the checkout importable as `dro_ext` when pytest runs from the repository root.
