"""An export round-trips through transformers: save_pretrained after a remote-code or a plain load writes a directory
that loads again (both ways) with the same logits; the loader stubs say what to install when s2hc is missing;
gradient checkpointing through transformers' switch; transformers' Trainer trains an export, with and without
gradient checkpointing, and the trained model saves and reloads."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import s2hc

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

import helpers  # noqa: E402
from helpers import OFFLINE_ENV  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.dynamic_module_utils import get_class_from_dynamic_module  # noqa: E402

import s2hc.hf  # noqa: E402
from s2hc.hf import S2HCConfig, S2HCForCausalLM, from_s2hc  # noqa: E402
from s2hc.hf.modeling import _CACHE_FIELD  # noqa: E402
from s2hc.hf.remote_code import AUTO_MAP, STUBS  # noqa: E402

IDS = torch.tensor([[5, 17, 300, 2, 99, 1000, 7, 42], [1, 2, 3, 4, 5, 6, 7, 8]])
# transformers 5 renamed gradient checkpointing to activation checkpointing and warns on the old names
OLD_NAMES = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")


@pytest.fixture(scope="module")
def exported(tiny_checkpoint, tmp_path_factory) -> Path:
    """``s2hc.hf.export`` of the shared 3-step s2hc (n = 4) checkpoint (tests/conftest.py)."""
    return s2hc.hf.export(tiny_checkpoint, tmp_path_factory.mktemp("export") / "model")


def remote_load(directory: Path):
    """What ``AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)`` does in a process that has
    not imported s2hc.hf: the classes of the directory's modules, marked as custom code, then from_pretrained."""
    config_class = get_class_from_dynamic_module(AUTO_MAP["AutoConfig"], str(directory))
    config_class.register_for_auto_class()
    model_class = get_class_from_dynamic_module(AUTO_MAP["AutoModelForCausalLM"], str(directory))
    model_class.register_for_auto_class("AutoModelForCausalLM")
    return model_class.from_pretrained(directory, config=config_class.from_pretrained(directory)).eval()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS).logits


def assert_saved_with_stubs(directory: Path) -> None:
    """``directory`` holds the current stubs, and its config.json their auto_map."""
    for name, text in STUBS.items():
        assert (directory / name).read_text() == text, name
    assert json.loads((directory / "config.json").read_text())["auto_map"] == AUTO_MAP


# ---- save_pretrained after a load ------------------------------------------------------------------------


def test_save_pretrained_after_a_remote_code_load_round_trips(exported, tmp_path):
    model = remote_load(exported)
    # the class is the stub's, defined in the directory's module, so that file is what transformers copies
    assert type(model).__module__.startswith("transformers_modules.") and type(model).__name__ == "S2HCForCausalLM"
    assert isinstance(model, S2HCForCausalLM) and isinstance(model.config, S2HCConfig)
    assert type(model)._auto_class == "AutoModelForCausalLM" and type(model.config)._auto_class == "AutoConfig"
    assert S2HCForCausalLM._auto_class is None and S2HCConfig._auto_class is None  # the package's stay unmarked
    expected = logits(S2HCForCausalLM.from_pretrained(exported))
    assert torch.equal(logits(model), expected)
    model.save_pretrained(tmp_path / "again")
    assert_saved_with_stubs(tmp_path / "again")
    assert torch.equal(logits(remote_load(tmp_path / "again")), expected)
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "again")), expected)
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "again", trust_remote_code=True)),
                       expected)  # fmt: skip


def test_save_pretrained_after_a_plain_load_keeps_the_stubs_and_auto_map(exported, tmp_path):
    model = S2HCForCausalLM.from_pretrained(exported)
    expected = logits(model)
    model.save_pretrained(tmp_path / "again")
    assert_saved_with_stubs(tmp_path / "again")
    assert torch.equal(logits(remote_load(tmp_path / "again")), expected)
    # and any S2HCForCausalLM, not only one loaded from an export
    fresh = from_s2hc(helpers.random_model("mhc", 2, vocab_size=4096))
    fresh.save_pretrained(tmp_path / "fresh")
    assert_saved_with_stubs(tmp_path / "fresh")
    assert torch.equal(logits(remote_load(tmp_path / "fresh")), logits(fresh))


def test_an_export_with_the_old_reexporting_modules_saves_too(exported, tmp_path):
    """Exports written before the stubs defined subclasses hand transformers the package's own classes."""
    old = tmp_path / "old"
    shutil.copytree(exported, old)
    (old / "configuration_s2hc.py").write_text("from s2hc.hf.configuration import S2HCConfig\n")
    (old / "modeling_s2hc.py").write_text("from s2hc.hf.modeling import S2HCForCausalLM\n")
    model = remote_load(old)
    assert type(model) is S2HCForCausalLM and S2HCForCausalLM._auto_class is None and S2HCConfig._auto_class is None
    model.save_pretrained(tmp_path / "again")
    assert_saved_with_stubs(tmp_path / "again")
    assert torch.equal(logits(remote_load(tmp_path / "again")), logits(model))


def _run(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **OFFLINE_ENV, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_trust_remote_code_load_save_and_reload_without_importing_s2hc(exported, tmp_path):
    """The user's report, as they ran it: a fresh process, trust_remote_code, save_pretrained, load again."""
    code = (
        "import os, sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "assert 's2hc' not in sys.modules\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(exported)!r}, trust_remote_code=True).eval()\n"
        f"ids = torch.tensor({IDS.tolist()})\n"
        "with torch.no_grad(): a = m(ids).logits\n"
        f"m.save_pretrained({str(tmp_path / 'again')!r})\n"
        f"r = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'again')!r}, trust_remote_code=True).eval()\n"
        "with torch.no_grad(): b = r(ids).logits\n"
        "from s2hc.hf import S2HCForCausalLM, S2HCConfig\n"
        "print(type(m).__module__.split('.')[0], torch.equal(a, b), S2HCForCausalLM._auto_class,\n"
        "      S2HCConfig._auto_class)\n"
    )
    done = _run(code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-4:] == ["transformers_modules", "True", "None", "None"]
    assert_saved_with_stubs(tmp_path / "again")
    with torch.no_grad():
        expected = S2HCForCausalLM.from_pretrained(exported).eval()(IDS).logits
    assert torch.equal(logits(S2HCForCausalLM.from_pretrained(tmp_path / "again")), expected)


def test_without_s2hc_the_stubs_say_what_to_install(exported, tmp_path):
    code = (
        "import sys\n"
        "sys.modules['s2hc'] = None  # not installed\n"
        "from transformers import AutoModelForCausalLM\n"
        "try:\n"
        f"    AutoModelForCausalLM.from_pretrained({str(exported)!r}, trust_remote_code=True)\n"
        "except ImportError as error:\n"
        "    print(str(error))\n"
    )
    done = _run(code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    message = done.stdout.strip().splitlines()
    assert len(message) == 1, done.stdout
    assert "pip install 's2hc[hf]'" in message[0] and f"written by s2hc {s2hc.__version__}" in message[0]
    for text in STUBS.values():  # the requirement is in each stub's docstring too
        assert "pip install 's2hc[hf]'" in text.split('"""')[1] and s2hc.__version__ in text.split('"""')[1]


# ---- gradient checkpointing through transformers' switch --------------------------------------------------


def _grads(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _block_runs(model):
    """A list that grows by one each time a block starts (a pre-hook on its attention)."""
    runs = []
    for block in model.model.blocks:
        block.attn.register_forward_pre_hook(lambda *_: runs.append(1))
    return runs


@OLD_NAMES
@pytest.mark.parametrize("family", ["residual", "mhc", "s2hc", "gated-residual"])
def test_gradient_checkpointing_enable_gives_the_plain_gradients(family):
    model = from_s2hc(helpers.random_model(family, 1 if family == "residual" else 3, vocab_size=4096)).train()
    assert model.supports_gradient_checkpointing
    ids = torch.randint(0, 4096, (2, 10), generator=torch.Generator().manual_seed(0))
    plain = _grads(model, ids)
    model.gradient_checkpointing_enable()
    assert all(block.gradient_checkpointing for block in model.model.blocks)
    runs = _block_runs(model)
    grads = _grads(model, ids)
    assert len(runs) == 2 * 2  # two blocks, each run again in the backward pass
    assert grads.keys() == plain.keys()
    for name in plain:
        torch.testing.assert_close(grads[name], plain[name], rtol=1e-6, atol=1e-7, msg=name)
    model.gradient_checkpointing_disable()
    assert not model.model.activation_checkpointing
    runs.clear()
    _grads(model, ids)
    assert len(runs) == 2


@OLD_NAMES
def test_every_n_layers_and_checkpoint_kwargs_reach_the_blocks():
    model = from_s2hc(helpers.random_model("s2hc", 2, vocab_size=4096, n_layers=3)).train()
    ids = torch.randint(0, 4096, (2, 10), generator=torch.Generator().manual_seed(0))
    plain = _grads(model, ids)
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is None:  # transformers 4
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    else:
        enable(activation_checkpointing_kwargs={"use_reentrant": True}, every_n_layers=2)
        assert [block.gradient_checkpointing for block in model.model.blocks] == [True, False, True]
    assert model.model.blocks[0]._gradient_checkpointing_func.keywords == {"use_reentrant": True}
    grads = _grads(model, ids)
    for name in plain:
        torch.testing.assert_close(grads[name], plain[name], rtol=1e-6, atol=1e-7, msg=name)


def test_training_forward_makes_no_cache_and_the_loss_honours_num_items_in_batch():
    model = from_s2hc(helpers.random_model("s2hc", 2, vocab_size=4096)).train()
    labels = IDS.clone()
    labels[0, :3] = -100
    out = model(input_ids=IDS, labels=labels)
    assert getattr(out, _CACHE_FIELD) is None
    counted = int((labels[:, 1:] != -100).sum())
    summed = model(input_ids=IDS, labels=labels, num_items_in_batch=torch.tensor(2 * counted)).loss
    torch.testing.assert_close(summed, out.loss / 2, rtol=1e-6, atol=0)
    with torch.no_grad():  # no gradients, no training step: a cache for decoding, as before
        assert getattr(model(input_ids=IDS), _CACHE_FIELD) is not None


# ---- transformers' Trainer on an export -------------------------------------------------------------------


def _dataset(vocab: int, n: int = 8, length: int = 16):
    rows = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row.clone()} for row in rows]


@OLD_NAMES
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_trainer_trains_an_export_and_the_result_saves_and_reloads(exported, tmp_path, checkpointing):
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (the hf extra)")
    from transformers import Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    steps, n_layers = 4, model.config.num_hidden_layers
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=2, learning_rate=1e-3,
        use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
        dataloader_num_workers=0, gradient_checkpointing=checkpointing,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=_dataset(model.config.vocab_size))
    runs = _block_runs(trainer.model)
    result = trainer.train()
    assert result.global_step == steps and math.isfinite(result.training_loss)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == steps and all(math.isfinite(loss) for loss in losses)
    assert len(runs) == steps * n_layers * (2 if checkpointing else 1)  # checkpointed blocks ran twice a step
    trained = trainer.model
    changed = {name for name, p in trained.named_parameters() if not torch.equal(p.detach(), before[name])}
    connection = {id(p) for p in trained.model.hyper_connection_parameters()}
    others = {name for name, p in trained.named_parameters() if id(p) not in connection}
    assert others <= changed  # every weight of the transformer moved (some of s2hc's start with zero gradient)
    assert changed - others  # and so did the connections'
    expected = logits(trained)
    trained.save_pretrained(tmp_path / "trained")
    assert_saved_with_stubs(tmp_path / "trained")
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "trained", trust_remote_code=True)),
                       expected)  # fmt: skip
    assert torch.equal(logits(remote_load(tmp_path / "trained")), expected)
    assert not torch.equal(expected, logits(S2HCForCausalLM.from_pretrained(exported)))
