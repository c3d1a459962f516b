"""Collection settings for the whole run (this file loads before any module of src/ is imported).

Triton decides when a kernel is decorated whether it runs compiled (GPU) or under its CPU interpreter,
so ``TRITON_INTERPRET`` must be set before ``s2hc.connection.kernels`` is imported, and doctest collection
imports every module of the package. Without a GPU the kernels are tested under the interpreter; without
triton that module is not collected at all (its tests skip).
"""

import importlib.util
import os

import torch

# tests/torchtitan_cpu patches torchtitan when imported: only the runs of tests/test_torchtitan.py load it.
collect_ignore = ["tests/torchtitan_cpu"]
if importlib.util.find_spec("torchtitan") is None or importlib.util.find_spec("triton") is None:
    collect_ignore.append("src/s2hc/torchtitan")  # the torchtitan extra's own modules
if importlib.util.find_spec("triton") is None:
    collect_ignore.append("src/s2hc/connection/kernels.py")
elif not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
