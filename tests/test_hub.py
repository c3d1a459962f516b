"""s2hc.hub: without a network the Hugging Face libraries are put offline for the call, so an evaluation or a
dataset that needs the Hub fails at once in one line instead of after five retries, and a cached one still loads."""

from __future__ import annotations

import os

import pytest

from s2hc import hub


def test_an_unreachable_hub_puts_the_libraries_offline_for_the_block_and_restores_them(monkeypatch):
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=hub.PROBE_TIMEOUT_S: False)
    for name in hub.OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    before = constants.HF_HUB_OFFLINE
    with hub.offline_if_unreachable() as offline:
        assert offline and constants.HF_HUB_OFFLINE is True
        assert all(os.environ[name] == "1" for name in hub.OFFLINE_VARIABLES)
    assert before == constants.HF_HUB_OFFLINE and not any(name in os.environ for name in hub.OFFLINE_VARIABLES)


def test_a_reachable_hub_or_an_offline_setting_changes_nothing(monkeypatch):
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=hub.PROBE_TIMEOUT_S: True)
    with hub.offline_if_unreachable() as offline:
        assert not offline
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=hub.PROBE_TIMEOUT_S: pytest.fail("probed"))
    with hub.offline_if_unreachable() as offline:
        assert not offline


def test_the_probe_is_one_connection_to_the_endpoint(monkeypatch):
    calls = []

    def connect(address, timeout):
        calls.append((address, timeout))
        raise OSError("no route")

    monkeypatch.setattr(hub.socket, "create_connection", connect)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example:8443")
    assert hub.hub_reachable() is False and calls == [(("hub.example", 8443), hub.PROBE_TIMEOUT_S)]


def test_an_hf_source_without_a_network_fails_in_one_line_without_retries(monkeypatch, capfd):
    """A Hub dataset while the Hub cannot be reached: the source's one-line error, and none of the client's
    ``Retrying in`` lines."""
    pytest.importorskip("datasets")
    from s2hc.data.sources import iter_documents

    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=hub.PROBE_TIMEOUT_S: False)
    for name in hub.OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError) as raised:
        next(iter_documents("hf:s2hc-test/no-such-dataset"))
    assert "\n" not in str(raised.value) and "no-such-dataset" in str(raised.value)
    assert "Retrying in" not in capfd.readouterr().err
    assert "HF_HUB_OFFLINE" not in os.environ  # restored after the call


def test_a_hub_tokenizer_without_a_network_fails_in_one_line_without_retries(monkeypatch, capfd):
    pytest.importorskip("tokenizers")
    from s2hc.data.tokenizer import get_tokenizer

    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=hub.PROBE_TIMEOUT_S: False)
    for name in hub.OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"^tokenizer 's2hc-test/no-such-model': not a shipped name .* the Hugging "
                                         r"Face Hub could not provide it"):
        get_tokenizer("s2hc-test/no-such-model")
    assert "Retrying in" not in capfd.readouterr().err
