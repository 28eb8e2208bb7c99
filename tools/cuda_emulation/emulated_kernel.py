"""pytest plugin (-p emulated_kernel): loads the library of one emulated .cu file (DRO_EXT_EMULATED_KERNEL, set by
emulate.py), whose kernels register as dro_ext's CPU kernels of that file's ops, so the CPU tests run the CUDA
kernels' code."""
import os
import warnings

import dro_ext  # noqa: F401  (the op schema and the real CPU kernel first)
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "overriding a previously registered kernel": that is the point
    torch.ops.load_library(os.environ["DRO_EXT_EMULATED_KERNEL"])
