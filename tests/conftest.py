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
