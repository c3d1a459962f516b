"""Test settings and fixtures shared by the suite: one hypothesis profile (reproducible in CI), a corpus
file and a tiny trained checkpoint."""

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "s2hc",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,  # CI failures must reproduce
)
settings.load_profile("s2hc")


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> Path:
    """~150 kB of the embedded corpus as a user's text file: real text, quick to tokenise."""
    from s2hc.data.corpus import load_corpus

    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("\n\n".join(load_corpus("train"))[:150_000])
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(corpus_file, tmp_path_factory) -> Path:
    """A real s2hc (n = 4) run directory: 3 training steps of the small model."""
    from helpers import small_config

    from s2hc.train import train

    config = small_config(corpus_file, tmp_path_factory.mktemp("tiny"))
    train(config)
    return Path(config.out)


# ------------------------------------------------------------------------------ the `cuda` marker
# Tests marked `cuda` (tests/test_cuda.py) run on a CUDA GPU and are skipped without one. S2HC_TEST_DEVICE
# names another device to run them on instead (S2HC_TEST_DEVICE=cpu: the dry run of benchmarks/gpu_check.sh).
TEST_DEVICE_ENV = "S2HC_TEST_DEVICE"


def cuda_test_device():
    """The device of the ``cuda``-marked tests: ``$S2HC_TEST_DEVICE`` when set, else ``cuda`` when
    ``torch.cuda.is_available()``, else None (they skip)."""
    import os

    import torch

    from s2hc.devices import resolve_device

    name = os.environ.get(TEST_DEVICE_ENV, "").strip()
    if name:
        try:
            return resolve_device(name, TEST_DEVICE_ENV)
        except ValueError as error:
            raise pytest.UsageError(str(error)) from None
    return torch.device("cuda") if torch.cuda.is_available() else None


def pytest_collection_modifyitems(config, items):
    if cuda_test_device() is not None:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU (or {TEST_DEVICE_ENV}=cpu to run it on the CPU)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cuda_device():
    """The device the ``cuda``-marked tests run on (see :func:`cuda_test_device`)."""
    device = cuda_test_device()
    if device is None:
        pytest.skip(f"needs a CUDA GPU (or {TEST_DEVICE_ENV}=cpu)")
    return device
