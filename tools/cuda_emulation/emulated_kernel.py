"""pytest plugin (-p emulated_kernel): registers the emulated CUDA kernel as dro_ext's CPU kernel of
normalized_sgd_step_, so the CPU tests run the CUDA kernel's code. Set by emulate.py."""
import os
import warnings

import dro_ext  # noqa: F401  (the op schema and the real CPU kernel first)
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "overriding a previously registered kernel": that is the point
    torch.ops.load_library(os.environ["DRO_EXT_EMULATED_KERNEL"])
