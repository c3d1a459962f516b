"""Reading a Hugging Face checkpoint's safetensors: one file, a directory of them, or a sharded checkpoint.

:func:`read_safetensors` reads the tensors a caller wants, one by one (``safetensors.safe_open``): with a
sharded checkpoint's index only the shards that hold them are opened, so reading a few tensors of a large
checkpoint costs what those tensors cost. ``s2hc upcycle`` reads everything, ``diagnose --static`` the
hyper-connections' biases.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["INDEX", "read_safetensors"]

INDEX = "model.safetensors.index.json"


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
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{str(index)!r} is not a safetensors index with a weight_map ({error})") from None
        files = {name: path / shard for name, shard in weight_map.items()}
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
    safetensors, a bad index, an unreadable file, or a missing safetensors package."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        raise ValueError("reading safetensors needs the safetensors package (pip install 's2hc[hf]')") from None
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
        try:
            with safe_open(str(file), framework="pt") as handle:
                opened.append(str(file))
                for name in names if names is not None else [k for k in handle.keys() if wanted(k)]:  # noqa: SIM118
                    tensors[name] = handle.get_tensor(name)
        except (OSError, SafetensorError) as error:
            raise ValueError(f"cannot read {str(file)!r}: {error}") from None
    return tensors, opened, directory
