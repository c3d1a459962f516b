"""The two loader modules every saved :class:`~s2hc.hf.S2HCForCausalLM` directory holds, for ``trust_remote_code``.

``configuration_s2hc.py`` and ``modeling_s2hc.py`` are stubs: each defines a subclass of the installed package's
class (``S2HCConfig``, ``S2HCForCausalLM``) and nothing else, so the directory loads with
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` where s2hc is installed
(``pip install 's2hc[hf]'``) but not imported (lm-eval's ``hf`` model type). Without s2hc they raise an
ImportError that says, in one line, what to install and which s2hc version wrote the directory.

Why subclasses and not ``from s2hc.hf.modeling import S2HCForCausalLM``: transformers marks the class a remote-code
load returns as custom code (``register_for_auto_class``), and its ``save_pretrained`` then copies the file that
defines that class, with the files of its relative imports, into the new directory
(``transformers.dynamic_module_utils.custom_object_save``). For a re-exported package class that file is
``s2hc/hf/modeling.py``, whose ``from ..models import ...`` it reads as ``s2hc/hf/.models.py``
(FileNotFoundError). A class defined in the stub makes the stub the file it copies, as transformers intends.
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import __version__
from ..io import atomic_write_text

#: ``config.json``'s ``auto_map``: the Auto class -> ``module.Class`` of the stubs.
AUTO_MAP = {
    "AutoConfig": "configuration_s2hc.S2HCConfig",
    "AutoModelForCausalLM": "modeling_s2hc.S2HCForCausalLM",
}

_GUARD = '''try:
    from s2hc.hf import {module} as _s2hc
except ImportError as error:  # transformers' own import check skips imports inside try
    raise ImportError(
        f"this model's code is the s2hc package, which could not be imported ({{error}}): "
        "pip install 's2hc[hf]' (the directory was written by s2hc {version})"
    ) from error
'''

_DOC = '''"""``{name}`` of an s2hc model directory, for ``from_pretrained(..., trust_remote_code=True)``.

A stub: the code is the installed s2hc package (``pip install 's2hc[hf]'``; this directory was written by
s2hc {version}), which must be importable wherever the directory is loaded. Without it, importing this file raises
an ImportError saying so. The class is a subclass defined here so that transformers' ``save_pretrained`` copies this
file, not the package's, into the directories it saves.
"""
'''

CONFIGURATION = (
    _DOC.format(name="S2HCConfig", version=__version__)
    + "\n"
    + _GUARD.format(module="configuration", version=__version__)
    + '''

class S2HCConfig(_s2hc.S2HCConfig):
    """:class:`s2hc.hf.S2HCConfig`."""

    def __init__(self, s2hc=None, **kwargs):  # an __init__ of its own keeps transformers' dataclass one away
        super().__init__(s2hc=s2hc, **kwargs)


__all__ = ["S2HCConfig"]
'''
)

MODELING = (
    _DOC.format(name="S2HCForCausalLM", version=__version__)
    + "\n"
    + _GUARD.format(module="modeling", version=__version__)
    + '''
from .configuration_s2hc import S2HCConfig


class S2HCForCausalLM(_s2hc.S2HCForCausalLM):
    """:class:`s2hc.hf.S2HCForCausalLM`."""

    config_class = S2HCConfig


__all__ = ["S2HCForCausalLM"]
'''
)

#: File name -> source of the stubs.
STUBS = {"configuration_s2hc.py": CONFIGURATION, "modeling_s2hc.py": MODELING}


def write_stubs(directory: str | os.PathLike) -> list[Path]:
    """Write :data:`STUBS` into ``directory`` (which exists), each atomically; returns their paths."""
    paths = [Path(directory) / name for name in STUBS]
    for path in paths:
        atomic_write_text(path, STUBS[path.name])
    return paths
