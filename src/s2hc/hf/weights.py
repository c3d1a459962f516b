"""Reading a Hugging Face checkpoint's safetensors: one file, a directory of them, or a sharded checkpoint.

:func:`read_safetensors` reads the tensors a caller wants, one by one (``safetensors.safe_open``): with a
sharded checkpoint's index only the shards that hold them are opened, so reading a few tensors of a large
checkpoint costs what those tensors cost. ``s2hc upcycle`` reads everything, ``diagnose --static`` the
hyper-connections' biases.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from ..extras import require
from ..io import json_kind, json_loads

__all__ = ["INDEX", "read_safetensors"]

INDEX = "model.safetensors.index.json"


def _read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a sharded checkpoint's index: tensor name -> shard file name, both strings.

    ValueError naming ``index`` when it is not JSON, not an object, or its weight_map is not such a map."""
    try:
        data = json_loads(index.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{str(index)!r} is not a safetensors index ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{str(index)!r} is not a safetensors index: it holds {json_kind(data)}, "
                         f"not an object with a weight_map")
    if "weight_map" not in data:
        raise ValueError(f"{str(index)!r} is not a safetensors index: it has no weight_map")
    weight_map = data["weight_map"]
    if not isinstance(weight_map, dict):
        raise ValueError(f"{str(index)!r}: weight_map is {json_kind(weight_map)}; it must be an object "
                         f"mapping tensor names to shard file names")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise ValueError(f"{str(index)!r}: weight_map maps {name!r} to {json_kind(shard)} ({shard!r}); "
                             f"shard file names are strings")
    return weight_map


def _confinement(directory: Path) -> Path:
    """The folder every shard file must resolve into: the checkpoint's directory; for a Hugging Face cache
    snapshot (``models--ORG--NAME/snapshots/REVISION/``, whose files are symlinks to ``../../blobs/``), the
    model's own cache folder, which holds only that model."""
    resolved = directory.resolve()
    if resolved.parent.name == "snapshots" and (resolved.parent.parent / "blobs").is_dir():
        return resolved.parent.parent
    return resolved


def _shard_path(index: Path, directory: Path, shard: str, confinement: Path) -> Path:
    """The file ``shard`` (a weight_map value) names in ``directory``. ValueError unless it is a relative path
    that stays in the directory, symlinks resolved (into ``confinement``): an index must not read another
    model's files, nor any other file it names."""
    path = Path(shard)
    if not shard or path.is_absolute() or path.drive or path.root:
        raise ValueError(f"{str(index)!r} names shard {shard!r}: shard files must be relative paths inside "
                         f"{str(directory)!r}, not absolute ones")
    if os.path.normpath(shard).split(os.sep)[0] == os.pardir:
        raise ValueError(f"{str(index)!r} names shard {shard!r}: shard files must stay inside "
                         f"{str(directory)!r} ('..' leaves it)")
    if not (directory / path).resolve().is_relative_to(confinement):
        raise ValueError(f"{str(index)!r} names shard {shard!r}: shard files must stay inside "
                         f"{str(directory)!r} (a symlink leads out of it)")
    return directory / path


def _files(path: Path) -> tuple[dict[str, Path] | None, list[Path], Path]:
    """``(weight_map, files, directory)``: a sharded checkpoint's name -> shard map (None without an index),
    the safetensors files, and the directory they are in."""
    if path.is_file():
        if path.name == INDEX:
            path = path.parent
        elif path.suffix == ".safetensors":
            return None, [path], path.parent
        else:
            raise ValueError(f"{str(path)!r} is not a .safetensors file, a {INDEX} or a directory holding them")
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} does not exist; give a .safetensors file or a directory holding them")
    index = path / INDEX
    if index.is_file():
        confinement = _confinement(path)
        files = {name: _shard_path(index, path, shard, confinement) for name, shard in _read_index(index).items()}
        return files, sorted(set(files.values())), path
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{str(path)!r} holds no .safetensors file and no {INDEX}")
    return None, files, path


def read_safetensors(
    path: str | Path, wanted: Callable[[str], bool] | None = None
) -> tuple[dict[str, torch.Tensor], list[str], Path]:
    """``(tensors, files opened, directory)``: every tensor of ``path`` whose name ``wanted(name)`` accepts (all
    without ``wanted``). ``path``: a ``.safetensors`` file, a directory of them, or a sharded checkpoint (its
    directory or its ``model.safetensors.index.json``); ``directory`` is where the files are (and a
    ``config.json`` beside them). ValueError (one sentence) for a path that does not exist or is not
    safetensors, a bad index or an unreadable file; MissingExtra without the safetensors package."""
    safetensors = require("safetensors", "reading safetensors")
    SafetensorError, safe_open = safetensors.SafetensorError, safetensors.safe_open  # noqa: N806 - their names
    wanted = wanted or (lambda name: True)
    weight_map, files, directory = _files(Path(path).expanduser())
    if weight_map is not None:  # only the shards that hold wanted tensors are opened
        names_by_file: dict[Path, list[str] | None] = {}
        for name, shard in weight_map.items():
            if wanted(name):
                names_by_file.setdefault(shard, []).append(name)
    else:
        names_by_file = {file: None for file in files}
    tensors, opened = {}, []
    for file, names in names_by_file.items():
        if not file.is_file():  # a shard the index names
            shard = str(file.relative_to(directory))
            raise ValueError(f"{str(directory / INDEX)!r} names shard {shard!r}, which is not in {str(directory)!r}; "
                             "the checkpoint is incomplete (download the shard again)")
        try:
            handle_context = safe_open(str(file), framework="pt")
        except (OSError, SafetensorError) as error:
            raise ValueError(f"{str(file)!r} is not a readable safetensors file (damaged, truncated or another "
                             f"format): {error}") from None
        with handle_context as handle:
            opened.append(str(file))
            present = set(handle.keys())  # noqa: SIM118 - a safe_open handle, not a dict
            for name in names if names is not None else sorted(k for k in present if wanted(k)):
                if name not in present:
                    raise ValueError(f"{str(file)!r} holds no tensor {name!r}, which {str(directory / INDEX)!r} "
                                     "places there; the index and its shards do not match")
                try:
                    tensors[name] = handle.get_tensor(name)
                except (OSError, SafetensorError) as error:
                    raise ValueError(f"{str(file)!r}: tensor {name!r} cannot be read (the file is damaged or "
                                     f"truncated): {error}") from None
    return tensors, opened, directory
