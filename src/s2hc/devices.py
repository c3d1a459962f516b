"""Where tensors live and in which precision: the one place that turns the names users type into torch objects.

``device`` names: ``"auto"`` (CUDA when ``torch.cuda.is_available()``, else the CPU), ``"cpu"``, ``"cuda"``,
``"cuda:N"``. ``dtype`` names for casting a model: ``"float32"``, ``"bfloat16"``, ``"float16"``. Training's
precision names (``TrainConfig.dtype``): ``"auto"`` (bfloat16 autocast where the device supports it),
``"float32"``, ``"bfloat16"``.

>>> resolve_device("cpu")
device(type='cpu')
>>> resolve_dtype("bfloat16")
torch.bfloat16
"""

from __future__ import annotations

import re

import torch

DEVICE_NAMES = ("auto", "cpu", "cuda", "cuda:N")
#: The spelling of those names, checked before a run starts (whether CUDA is there is resolve_device's question).
DEVICE_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTOCAST_NAMES = ("auto", "float32", "bfloat16")  # TrainConfig.dtype


def resolve_device(name: str | torch.device | None = "auto", argument: str = "device") -> torch.device:
    """The device named ``name`` (a :class:`torch.device` is returned as it is; None means ``"auto"``).

    ValueError naming ``argument``, the value and the allowed names for anything else, and for a CUDA
    device where there is none.
    """
    if isinstance(name, torch.device):
        return name
    allowed = ", ".join(DEVICE_NAMES)
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"{argument}: invalid choice {name!r}; allowed: {allowed}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{argument}: {name!r} needs a CUDA GPU, and torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}); allowed: {allowed} (auto picks cpu here)"
        )
    return device


def resolve_dtype(name: str | torch.dtype | None, argument: str = "dtype") -> torch.dtype | None:
    """The dtype named ``name`` (one of :data:`DTYPES`); a :class:`torch.dtype` or None is returned as it is."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"{argument} must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def autocast_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of training precision ``name`` on ``device``: bfloat16 where asked, or (for
    ``"auto"``) where the device supports it; None for float32 (no autocast)."""
    if name not in AUTOCAST_NAMES:
        raise ValueError(f"dtype must be one of {list(AUTOCAST_NAMES)}, got {name!r}")
    if name == "float32":
        return None
    if name == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def cpu_model() -> str:
    """The CPU's model name with its family, model and stepping where ``/proc/cpuinfo`` has them (a VM's name
    alone, "Intel(R) Xeon(R) Processor", tells two CPU generations apart only by them); ``platform.processor()`` or
    the machine's architecture where there is no such file."""
    import platform

    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                key = key.strip()
                if not key and fields:  # the first processor's block ends
                    break
                if key in ("model name", "cpu family", "model", "stepping"):
                    fields.setdefault(key, value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    ids = ", ".join(f"{key} {fields[key]}" for key in ("cpu family", "model", "stepping") if key in fields)
    return f"{name} ({ids})" if ids else name


def platform_record(device: torch.device) -> dict[str, object]:
    """What decides a run's rounding besides its code and settings: the CPU model and the vector instructions
    torch's kernels use on it, the torch build, torch's thread count and the device (the GPU's name on CUDA). A
    training run records it at every start."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"cpu": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "device": gpu or device.type}
