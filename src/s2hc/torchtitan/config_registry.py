"""The ``--config`` functions of ``torchrun ... -m torchtitan.train --module s2hc.torchtitan --config NAME``: each
returns a ``Trainer.Config`` whose model is an :class:`~s2hc.torchtitan.model.S2HCDecoder`.

``NAME`` is ``FAMILY[_nN]_SIZE``: any family of :func:`s2hc.families` with its dashes as underscores (``s2hc``,
``mhc``, ``attn_res``, ``gated_residual``, ...), optionally its stream count, and a size of :data:`SIZES`:
``s2hc_debugmodel``, ``mhc_n8_tiny``, ``residual_qwen3_0_6b``. ``tiny`` and ``debugmodel`` train on s2hc's
embedded corpus (dataset ``s2hc_corpus``, registered here) with its 4096-token tokenizer (``hf_assets_path`` is the
package's data directory), nothing downloaded; ``qwen3_0_6b`` is the paper's Qwen3-0.6B on C4, ``qwen2_5_1_5b`` and
``gemma3_1b`` the shapes of s2hc's other paper models (:func:`config`).
The trainer's fields change on the command line (``--training.steps``, ``--parallelism.data_parallel_shard_degree``,
...); the model's do not (torchtitan keeps ``model_spec`` off its command line): a family's options, learned
stream scaling or another read are a config function of one's own, :func:`config` with them.

Attention is FlexAttention where CUDA is available and plain causal SDPA otherwise (the CPU, where FlexAttention
has no backward; SDPA does not mask across the packed documents).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import torch
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataLoader
from torchtitan.models.common import ComplexRoPE
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.llama3 import _build_llama3_layers as build_llama3_layers
from torchtitan.models.llama3 import llama3_configs
from torchtitan.models.qwen3 import qwen3_configs
from torchtitan.trainer import Trainer

from ..connection.forms import families
from ..data.corpus import load_corpus
from ..data.tokenizer import shipped_tokenizer_path
from .model import S2HCDecoder, causal_sdpa, s2hc_model_config, s2hc_model_spec

__all__ = ["CORPUS_VOCAB", "SIZES", "config", "trainer_config"]

#: The vocabulary of s2hc's shipped tokenizer, the debug models' size.
CORPUS_VOCAB = 4096


def _corpus(split: str):
    from datasets import Dataset

    return Dataset.from_list([{"text": text} for text in load_corpus(split)])


# torchtitan's registry of text datasets: s2hc's embedded corpus (its train split; `--dataloader.dataset_path
# validation` reads the other), in memory, nothing downloaded.
DATASETS["s2hc_corpus"] = DatasetConfig(path="train", loader=_corpus, sample_processor=lambda sample: sample["text"])


def _with_vocab(config, vocab: int):
    config.vocab_size = vocab
    config.tok_embeddings = dataclasses.replace(config.tok_embeddings, num_embeddings=vocab)
    config.lm_head = dataclasses.replace(config.lm_head, out_features=vocab)
    return config


def trainer_config(model: S2HCDecoder.Config, flavor: str, *, hf_assets_path: str | None = None,
                   dataset: str = "s2hc_corpus", seq_len: int = 256, local_batch_size: int = 2, steps: int = 10,
                   lr: float = 8e-4) -> Trainer.Config:
    """A ``Trainer.Config`` for ``model``, otherwise torchtitan's llama3 debug settings (AdamW, warmup 2, linear
    decay, selective activation checkpointing, a checkpoint every 10 steps), on s2hc's corpus and tokenizer unless
    told otherwise."""
    return Trainer.Config(
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=model.vocab_size)),
        hf_assets_path=hf_assets_path or str(shipped_tokenizer_path().parent),
        model_spec=s2hc_model_spec(model, flavor),
        optimizer=default_adamw(lr=lr),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                  min_lr_factor=0.0),
        training=TrainingConfig(local_batch_size=local_batch_size, seq_len=seq_len, steps=steps),
        dataloader=HuggingFaceTextDataLoader.Config(dataset=dataset),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(),
        checkpoint=CheckpointManager.Config(interval=10, last_save_model_only=False),
        activation_checkpoint=SelectiveAC.Config(),
    )


def _tiny() -> tuple[Decoder.Config, str]:
    base = _with_vocab(llama3_configs["debugmodel"](attn_backend="flex"), CORPUS_VOCAB)
    dim, heads = 64, 4
    base.dim = dim
    base.tok_embeddings = dataclasses.replace(base.tok_embeddings, embedding_dim=dim)
    base.norm = dataclasses.replace(base.norm, normalized_shape=dim)
    base.lm_head = dataclasses.replace(base.lm_head, in_features=dim)
    base.layers = build_llama3_layers(
        n_layers=2, dim=dim, n_heads=heads, hidden_dim=128, attn_backend="flex",
        rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=4096, theta=500000, scaling="llama"))
    return base, "llama3"


def _debugmodel() -> tuple[Decoder.Config, str]:
    return _with_vocab(llama3_configs["debugmodel"](attn_backend="flex"), CORPUS_VOCAB), "llama3"


def _qwen3_0_6b() -> tuple[Decoder.Config, str]:
    return qwen3_configs["0.6B"](attn_backend="flex"), "qwen3"


def _qwen3_style(*, vocab: int, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 hidden_dim: int, max_seq_len: int, qk_norm: bool, qkv_bias: bool) -> Decoder.Config:
    """A dense decoder of qwen3's blocks and initialisations (RMSNorm eps 1e-6, CosSinRoPE base 1e6, SwiGLU, fused
    QKV, tied embeddings) at other shapes, with or without QK-norm and q/k/v biases."""
    from torchtitan.models import qwen3 as titan_qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.config_utils import get_attention_config, make_ffn_config, make_gqa_config
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.qwen3 import Qwen3Model
    from torchtitan.models.qwen3.model import Qwen3TransformerBlock

    linear = titan_qwen3._LINEAR_INIT

    def norm(width: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=width, eps=1e-6, param_init=titan_qwen3._NORM_INIT)

    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=max_seq_len, theta=1_000_000.0)
    layers = []
    for _ in range(n_layers):
        attention = make_gqa_config(dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                                    wqkv_param_init=linear, wo_param_init=linear,
                                    inner_attention=get_attention_config("flex"), fuse_qkv=True, rope=rope,
                                    qk_norm=norm(head_dim) if qk_norm else None)
        attention.qkv_linear.wqkv = dataclasses.replace(attention.qkv_linear.wqkv, bias=qkv_bias)
        layers.append(Qwen3TransformerBlock.Config(
            attention_norm=norm(dim), ffn_norm=norm(dim), attention=attention,
            feed_forward=make_ffn_config(dim=dim, hidden_dim=hidden_dim, w1_param_init=linear,
                                         w2w3_param_init=linear)))
    return Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=norm(dim), enable_weight_tying=True, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=titan_qwen3._EMBEDDING_SKIP_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=linear))


def _qwen2_5_1_5b() -> tuple[Decoder.Config, str]:
    """Qwen/Qwen2.5-1.5B's shapes (s2hc's ``qwen2.5-1.5b`` preset): width 1536, 28 layers, 12 query and 2 key/value
    heads of 128, MLP 8960, q/k/v biases, no QK-norm, tied, vocabulary 151936. The RoPE table is 32768 positions
    (the model's 131072 would cost torchtitan a 128 MiB table in every layer, for runs of 2048)."""
    return _qwen3_style(vocab=151936, dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128,
                        hidden_dim=8960, max_seq_len=32768, qk_norm=False, qkv_bias=True), "qwen3"


def _gemma3_1b() -> tuple[Decoder.Config, str]:
    """google/gemma-3-1b-pt's shapes (s2hc's ``gemma3-1b`` preset): width 1152, 26 layers, 4 query heads and 1
    key/value head of 256 (attention scale 256^-0.5, as Gemma3's query_pre_attn_scalar), MLP 6912, QK-norm, RMSNorm
    eps 1e-6, tied, vocabulary 262144, in qwen3's blocks. What torchtitan's decoder has not, and this model lacks:
    the five-local-to-one-global sliding-window pattern (window 512, local RoPE base 1e4; every layer here is global
    with base 1e6), the sandwich post-norms, GeGLU (tanh GELU; here SwiGLU), the embedding scaled by sqrt(1152); and
    Gemma's RMSNorm stores ``w`` started at zero and scales by ``1 + w``, these the scale itself started at one (the
    same functions, another parametrisation). The RoPE table is 32768 positions, Gemma3-1B's context."""
    return _qwen3_style(vocab=262144, dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, head_dim=256,
                        hidden_dim=6912, max_seq_len=32768, qk_norm=True, qkv_bias=False), "qwen3"


#: The sizes: the torchtitan base config (its blocks, inits and RoPE) and its architecture.
SIZES = {"tiny": _tiny, "debugmodel": _debugmodel, "qwen3_0_6b": _qwen3_0_6b, "qwen2_5_1_5b": _qwen2_5_1_5b,
         "gemma3_1b": _gemma3_1b}

#: The paper-shape sizes' training (s2hc's configs/*.yaml for the same model, or the s²HC paper's Qwen3-0.6B run):
#: where the tokenizer is (``--hf_assets_path``; torchtitan's download script's directory), per-process batch, steps,
#: peak learning rate and warmup; C4, sequence 2048, cosine decay to a tenth, a checkpoint every 500 steps.
PAPER_SIZES = {
    "qwen3_0_6b": dict(hf_assets_path="./assets/hf/Qwen3-0.6B", local_batch_size=8, steps=10000, lr=3e-4,
                       warmup_steps=600),
    "qwen2_5_1_5b": dict(hf_assets_path="./assets/hf/Qwen2.5-1.5B", local_batch_size=4, steps=14305, lr=4e-4,
                         warmup_steps=1000),
    "gemma3_1b": dict(hf_assets_path="./assets/hf/gemma-3-1b-pt", local_batch_size=8, steps=19073, lr=4e-4,
                      warmup_steps=1000),
}


def config(family: str = "s2hc", size: str = "debugmodel", n_streams: int | None = None, *, optimizer: str = "adamw",
           **model: Any) -> Trainer.Config:
    """The ``Trainer.Config`` of ``family`` at ``size`` (a key of :data:`SIZES`); ``n_streams`` and ``model`` (the
    other fields of :class:`~s2hc.torchtitan.model.S2HCDecoder.Config`: ``stream_reduce``, ``lss_init``,
    ``family_options``, ``init_seed``) as :func:`~s2hc.torchtitan.model.s2hc_model_config` takes them.
    ``optimizer``: ``"adamw"`` (torchtitan's ``default_adamw``: one group, every parameter decaying) or ``"muon"``
    (:func:`s2hc.torchtitan.optim.muon_optimizer`: torchtitan's DistMuon over the branches' matrices, AdamW over the
    rest, as s2hc's harness routes them; DistMuon needs CUDA), at the size's learning rate.

    - ``tiny`` (width 64, 2 layers, 4 heads: the tests' size), ``debugmodel`` (torchtitan's llama3 ``debugmodel``:
      width 256, 6 layers, 16 heads): s2hc's embedded corpus and 4096-token tokenizer, sequence 64 / 256.
    - ``qwen3_0_6b``: the paper's Qwen3-0.6B (torchtitan's qwen3 ``0.6B``: width 1024, 28 layers, tied embeddings,
      vocabulary 151936) on C4 with Qwen3's tokenizer (``--hf_assets_path``; torchtitan's download script puts it
      in ``./assets/hf/Qwen3-0.6B``), sequence 2048, AdamW 3e-4 with cosine decay.
    - ``qwen2_5_1_5b``, ``gemma3_1b``: Qwen2.5-1.5B's and Gemma3-1B's shapes (:func:`_qwen2_5_1_5b`,
      :func:`_gemma3_1b`: what of Gemma3 torchtitan's decoder lacks) on C4 with their tokenizers, as
      ``configs/qwen2.5-1.5b.yaml`` and ``configs/gemma3-1b.yaml`` train them (:data:`PAPER_SIZES`).
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    if optimizer not in ("adamw", "muon"):
        raise ValueError(f"optimizer must be one of ['adamw', 'muon'], got {optimizer!r}")
    trainer = _trainer(family, size, n_streams, **model)
    if optimizer == "muon":
        from .optim import muon_optimizer

        lr = trainer.optimizer.param_groups[0].optimizer_kwargs["lr"]
        trainer.optimizer = muon_optimizer(trainer.model_spec.model, lr=lr)
    return trainer


def _trainer(family: str, size: str, n_streams: int | None, **model: Any) -> Trainer.Config:
    base, architecture = SIZES[size]()
    if not torch.cuda.is_available():
        base = causal_sdpa(base)  # torchtitan's builders take flex or varlen only: SDPA is swapped in
    model_config = s2hc_model_config(base, family, architecture=architecture, n_streams=n_streams, **model)
    if size in PAPER_SIZES:
        paper = dict(PAPER_SIZES[size])
        warmup_steps = paper.pop("warmup_steps")
        trainer = trainer_config(model_config, size, dataset="c4", seq_len=2048, **paper)
        trainer.lr_scheduler = LRSchedulersContainer.Config(warmup_steps=warmup_steps, decay_ratio=0.8,
                                                            decay_type="cosine", min_lr_factor=0.1)
        trainer.checkpoint = CheckpointManager.Config(interval=500, last_save_model_only=False)
        return trainer
    if size == "tiny":
        return trainer_config(model_config, size, seq_len=64, local_batch_size=2, steps=4)
    return trainer_config(model_config, size)


_NAME = re.compile(r"(?P<family>[a-z0-9_]+?)(?:_n(?P<streams>[0-9]+))?_(?P<size>" + "|".join(SIZES) + ")")


def __getattr__(name: str) -> Callable[[], Trainer.Config]:
    """``--config FAMILY[_nN]_SIZE``: ``s2hc_debugmodel``, ``mhc_n8_tiny``, ``attn_res_qwen3_0_6b``, ... (the
    family's dashes as underscores), each a function returning :func:`config`'s ``Trainer.Config``."""
    match = _NAME.fullmatch(name)
    by_name = {family.replace("-", "_"): family for family in families()}
    if match is None or match["family"] not in by_name:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (the configs are FAMILY[_nN]_SIZE, "
                             f"FAMILY one of {sorted(by_name)}, SIZE one of {sorted(SIZES)})")
    streams = None if match["streams"] is None else int(match["streams"])
    return functools.partial(config, by_name[match["family"]], match["size"], streams)
