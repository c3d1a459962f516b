"""Whether the Hugging Face Hub can be reached, and the Hugging Face libraries put offline when it cannot.

Without a network the Hub client retries every request five times with backoff (``Retrying in 1s … 8s``, about 23 s
and ten lines) before the error s2hc then translates into one sentence. :func:`offline_if_unreachable` asks first:
one TCP connection to the Hub's endpoint (``HF_ENDPOINT``, default huggingface.co) with a short timeout; when it
fails, the block runs with the libraries offline (``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE``), so what is in the
local cache still loads and what is not fails at once, as it does when the user sets those variables.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Iterator
from urllib.parse import urlparse

#: The variables that put the Hugging Face libraries offline.
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
#: How long the reachability probe waits for the Hub's endpoint, in seconds.
PROBE_TIMEOUT_S = 3.0


def offline_variable() -> str | None:
    """The environment variable that already puts the Hugging Face libraries offline, or None."""
    for name in OFFLINE_VARIABLES:
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return name
    return None


def hub_reachable(timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the Hub's endpoint opens within ``timeout`` seconds."""
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout):
            return True
    except OSError:
        return False


def _loaded_flags() -> list[tuple[object, str]]:
    """The offline flags of the Hugging Face modules already imported (they read the variables at import)."""
    flags = []
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        flags.append((constants, "HF_HUB_OFFLINE"))
    config = sys.modules.get("datasets.config")
    if config is not None:
        flags += [(config, name) for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if hasattr(config, name)]
    transformers_hub = sys.modules.get("transformers.utils.hub")
    if transformers_hub is not None and hasattr(transformers_hub, "_is_offline_mode"):
        flags.append((transformers_hub, "_is_offline_mode"))
    return flags


@contextlib.contextmanager
def offline_if_unreachable() -> Iterator[bool]:
    """Run the block with the Hugging Face libraries offline when the Hub cannot be reached (and they are not
    offline already); yields whether it put them offline. Everything is restored afterwards."""
    if offline_variable() is not None or hub_reachable():
        yield False
        return
    saved_env = {name: os.environ.get(name) for name in OFFLINE_VARIABLES}
    saved_flags = [(module, name, getattr(module, name)) for module, name in _loaded_flags()]
    for name in OFFLINE_VARIABLES:
        os.environ[name] = "1"
    for module, name, _ in saved_flags:
        setattr(module, name, True)
    try:
        yield True
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for module, name, value in saved_flags:
            setattr(module, name, value)
