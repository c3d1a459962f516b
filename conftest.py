"""Collection settings for the whole run (this file loads before any module of src/ is imported).

Triton decides when a kernel is decorated whether it runs compiled (GPU) or under its CPU interpreter,
so ``TRITON_INTERPRET`` must be set before ``s2hc.connection.kernels`` is imported, and doctest collection
imports every module of the package. Without a GPU the kernels are tested under the interpreter; without
triton that module is not collected at all (its tests skip).
"""

import importlib.util
import os

import torch

collect_ignore = []
if importlib.util.find_spec("triton") is None:
    collect_ignore.append("src/s2hc/connection/kernels.py")
elif not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
