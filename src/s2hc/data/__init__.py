"""Data for pretraining: the embedded corpus, tokenizers, document sources, token shards and batch loaders.

Typical use::

    from s2hc.data import get_tokenizer, prepare_tokens, TokenBatches, eval_batches

    tok = get_tokenizer("s2hc-bpe-4k")                       # or "gpt2", a tokenizer.json, a Hub name
    train = prepare_tokens("embedded", tok, "cache", "train")  # np.memmap of uint16 ids, tokenised once
    val = prepare_tokens("embedded", tok, "cache", "val")
    batches = TokenBatches(train, seq_len=256, batch_size=8, seed=0)
    x, y = next(batches)                                     # int64 (8, 256) each; y is x shifted by one
    for x, y in eval_batches(val, 256, 8, max_batches=20): ...

Sources (:mod:`s2hc.data.sources`): ``"embedded"``, ``.txt`` / ``.jsonl`` / ``.jsonl.gz`` / ``.json`` (an array
of records or strings) / ``.parquet`` files, ``datasets.save_to_disk`` folders (a Dataset or a DatasetDict), a
directory of them, ``"hf:NAME[:CONFIG]"`` (optionally with ``data_files``, e.g. ``"hf:json"`` on local files).
How a source is read is a :class:`SourceSpec` (``text_field``, ``val_source``, ``val_text_field``,
``val_fraction``, ``max_documents``, ``max_chars``, ``hf_split``, ``data_files``, ``max_tokens``, ``streaming``),
which :func:`prepare_tokens`, :func:`iter_documents` and :class:`ChunkStream` take as ``spec=`` (or its fields by
name: ``prepare_tokens(path, tok, split="val", val_fraction=0.1)``); a run's is ``TrainConfig.source_spec()``::

    val = prepare_tokens(config.data, tok, config.cache_dir, "val", spec=config.source_spec())

A dataset too large to tokenise before the first step (``hf:`` sources, say) is streamed instead
(:mod:`s2hc.data.stream`): a ``ChunkStream`` tokenises it chunk by chunk as ``StreamBatches`` reads it::

    stream = ChunkStream("hf:HuggingFaceFW/fineweb-edu:sample-100BT", tok, "cache", "train", prefetch=2)
    batches = StreamBatches(stream, seq_len=256, batch_size=8, seed=0)   # the same (x, y) as TokenBatches'
"""

from .corpus import corpus_info, load_corpus, load_documents
from .loader import StreamBatches, TokenBatches, eval_batches
from .shards import default_cache_dir, prepare_tokens
from .sources import SourceSpec, iter_documents
from .stream import ChunkStream
from .tokenizer import Tokenizer, get_tokenizer

__all__ = [
    "load_corpus",
    "load_documents",
    "corpus_info",
    "get_tokenizer",
    "Tokenizer",
    "iter_documents",
    "SourceSpec",
    "prepare_tokens",
    "default_cache_dir",
    "TokenBatches",
    "ChunkStream",
    "StreamBatches",
    "eval_batches",
]
