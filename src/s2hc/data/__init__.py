"""Data for pretraining: the embedded corpus, tokenizers, document sources, token shards and batch loaders.

Typical use::

    from s2hc.data import get_tokenizer, prepare_tokens, TokenBatches, eval_batches

    tok = get_tokenizer("s2hc-bpe-4k")                       # or "gpt2", a tokenizer.json, a Hub name
    train = prepare_tokens("embedded", tok, "cache", "train")  # np.memmap of uint16 ids, tokenised once
    val = prepare_tokens("embedded", tok, "cache", "val")
    batches = TokenBatches(train, seq_len=256, batch_size=8, seed=0)
    x, y = next(batches)                                     # int64 (8, 256) each; y is x shifted by one
    for x, y in eval_batches(val, 256, 8, max_batches=20): ...
"""

from .corpus import corpus_info, load_corpus, load_documents
from .loader import TokenBatches, eval_batches
from .shards import default_cache_dir, prepare_tokens
from .sources import iter_documents
from .tokenizer import Tokenizer, get_tokenizer

__all__ = [
    "load_corpus",
    "load_documents",
    "corpus_info",
    "get_tokenizer",
    "Tokenizer",
    "iter_documents",
    "prepare_tokens",
    "default_cache_dir",
    "TokenBatches",
    "eval_batches",
]
