"""Test-only: what torchtitan 0.3.0 needs to train on a CPU with torch 2.13, applied from outside torchtitan before the
trainer starts (imported by this package's ``config_registry``, the ``--module`` of tests/test_torchtitan.py's runs).

1. torchtitan picks ``device_type = "cuda"`` when no accelerator is found and calls ``torch.cuda.set_device``:
   rebind its ``device_type`` / ``device_module`` (in every module that imported them) to the CPU and a
   ``torch.cpu``-like module with the memory functions it asks for (zeros).
2. torch 2.13 has no ``torch.distributed.set_timeout``, which the trainer calls after the first step: define it.
3. torchtitan sets a gradient divide factor of 1.0 on every FSDP module, which FSDP2 turns into a PREMUL_SUM
   reduce-scatter that gloo lacks: force plain SUM reductions as well (the same arithmetic).

On CUDA only fix 2 applies (``benchmarks/torchtitan_check.py``, the GPU check's torchtitan step, runs through this
package on the device image's torch 2.11). Tied to torchtitan 0.3.0 and torch 2.13 (both pinned in constraints.txt);
revise on an upgrade. Attention is plain causal SDPA on a CPU, chosen by s2hc.torchtitan's config registry itself
(FlexAttention has no CPU backward).
"""

from __future__ import annotations

import sys
import types
from datetime import timedelta

import torch
import torch.distributed as dist


def _cpu_device_module() -> types.ModuleType:
    module = types.ModuleType("torchtitan_cpu_device")
    properties = types.SimpleNamespace(total_memory=1, name="cpu")
    module.set_device = lambda device: None
    module.current_device = lambda: 0
    module.device_count = lambda: 1
    module.synchronize = lambda device=None: None
    module.empty_cache = lambda: None
    module.get_device_name = lambda device=None: "cpu"
    module.get_device_properties = lambda device=None: properties
    module.memory_stats = lambda device=None: {}
    module.reset_peak_memory_stats = lambda device=None: None
    module.memory = types.SimpleNamespace(empty_cache=lambda: None, memory_stats=lambda device=None: {},
                                          reset_peak_memory_stats=lambda device=None: None)
    module.is_available = lambda: True
    return module


def apply() -> None:
    import torchtitan.tools.utils as utils

    if getattr(utils, "_s2hc_cpu_fixes", False):
        return
    utils._s2hc_cpu_fixes = True
    if not hasattr(dist, "set_timeout"):  # fix 2, on a GPU too (the GPU check's torchtitan step, torch 2.11)
        def set_timeout(timeout: timedelta, group=None) -> None:
            group = group or dist.distributed_c10d._get_default_group()
            group.set_timeout(timeout)  # the process group's own setter, what newer torch calls

        dist.set_timeout = set_timeout
    if torch.cuda.is_available():  # fixes 1 and 3 are the CPU's and gloo's
        return

    device_module = _cpu_device_module()
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan") and module is not None:
            if getattr(module, "device_type", None) == "cuda":
                module.device_type = "cpu"
            if getattr(module, "device_module", None) is torch.cuda:
                module.device_module = device_module

    from torch.distributed.fsdp import FSDPModule

    divide = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self, factor: float) -> None:
        divide(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


# every torchtitan module that imports device_type / device_module must be loaded before the rebinding
import torchtitan.components.metrics  # noqa: E402, F401
import torchtitan.distributed.utils  # noqa: E402, F401
import torchtitan.trainer  # noqa: E402, F401

apply()
