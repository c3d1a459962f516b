"""The lm-evaluation-harness model ``s2hc``: a native ``lm_eval.api.model.LM`` for s2hc checkpoints.

Importing this module registers the name ``s2hc`` in lm-eval's model registry, so that (in the same process)
``lm_eval.simple_evaluate(model="s2hc", model_args="checkpoint=runs/s2hc", tasks=[...])`` works. From the
command line: ``s2hc eval CHECKPOINT --tasks ...``, or lm-eval's own CLI through ``python -m s2hc.evaluate
--model s2hc --model_args checkpoint=PATH --tasks ...`` (see ``docs/evaluation.md`` for ``lm_eval`` itself).

Model arguments (``--model_args key=value,...``): ``checkpoint`` (or ``pretrained``): a run directory or a
checkpoint file; ``batch_size`` (default 8; ``auto`` means 8); ``device`` (``auto``: CUDA if available);
``dtype`` (``float32``, ``bfloat16``, ``float16``); ``max_length`` (context length, default the model's
``max_seq_len``); ``max_gen_toks`` (default 256); ``progress`` (default True). lm-eval's CLI passes
``--batch_size`` (default 1) and ``--device`` (default ``cuda``, which falls back to the CPU here) itself: give
them as its own options, not in ``--model_args``. In Python, ``S2HCLM(model=..., tokenizer=...)`` wraps a
model already in memory.

Requests are batched (sorted by length, right-padded for scoring, left-padded for generation); inputs longer
than the context are cut from the left, as lm-eval's ``hf`` model does; ``loglikelihood_rolling`` uses
lm-eval's disjoint rolling windows; ``generate_until`` decodes greedily (sampling if ``do_sample`` with a
``temperature`` > 0) with a KV cache until a stop sequence or the end-of-text token.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..devices import resolve_device, resolve_dtype
from ..extras import require
from .generation import generate_tokens
from .loading import load_for_eval

require("lm_eval.models", "the lm-eval model 's2hc'")  # lm-eval's own models first: its registry loads them
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry, register_model
from lm_eval.models.utils import Collator
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

MODEL_NAME = "s2hc"
DEFAULT_BATCH_SIZE = 8
DEFAULT_MAX_GEN_TOKS = 256


def _batch_size(value) -> int:
    if value is None:
        return DEFAULT_BATCH_SIZE
    if isinstance(value, str):
        if value.startswith("auto"):
            return DEFAULT_BATCH_SIZE
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"batch_size must be an integer >= 1 or 'auto', got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"batch_size must be an integer >= 1 or 'auto', got {value!r}")
    return value


class S2HCLM(TemplateLM):
    """lm-eval model for an s2hc checkpoint (see the module docstring for the arguments)."""

    backend = "causal"

    def __init__(
        self,
        checkpoint: str | None = None,
        *,
        pretrained: str | None = None,
        model=None,
        tokenizer=None,
        batch_size: int | str | None = DEFAULT_BATCH_SIZE,
        max_batch_size: int | None = None,
        device: str | None = "auto",
        dtype: str | None = None,
        max_length: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        progress: bool = True,
        **unknown: Any,
    ):
        super().__init__()
        if unknown:
            raise ValueError(
                f"unknown model_args {sorted(unknown)} for --model s2hc; allowed: checkpoint, batch_size, device, "
                "dtype, max_length, max_gen_toks, progress"
            )
        if checkpoint is not None and pretrained is not None and checkpoint != pretrained:
            raise ValueError("give checkpoint=PATH or pretrained=PATH, not both")
        checkpoint = checkpoint if checkpoint is not None else pretrained
        if isinstance(device, str) and device.startswith("cuda") and not torch.cuda.is_available():
            warnings.warn(f"device {device!r} is not available (lm-eval's CLI defaults to 'cuda'); using the CPU",
                          stacklevel=2)
            device = "cpu"
        if model is not None:
            if tokenizer is None:
                raise ValueError("S2HCLM(model=...) needs tokenizer= too (an s2hc.data.Tokenizer)")
            self.model = model.eval()
            target_dtype = resolve_dtype(dtype)
            if target_dtype is not None:
                self.model = self.model.to(target_dtype)
            if device not in (None, "auto"):
                self.model = self.model.to(resolve_device(device))
            self.tokenizer = tokenizer
            self.checkpoint = None
        else:
            if checkpoint is None:
                raise ValueError("--model s2hc needs --model_args checkpoint=PATH (a run directory or checkpoint file)")
            self.model, self.tokenizer, _ = load_for_eval(checkpoint, device=device, dtype=dtype)
            self.checkpoint = str(checkpoint)
        self._device = next(self.model.parameters()).device
        self.batch_size = _batch_size(batch_size)
        self._max_length = int(max_length) if max_length is not None else self.model.config.max_seq_len
        if not 1 <= self._max_length <= self.model.config.max_seq_len:
            raise ValueError(f"max_length must be in [1, {self.model.config.max_seq_len}], got {max_length!r}")
        self.max_gen_toks = int(max_gen_toks)
        self.progress = progress if isinstance(progress, bool) else str(progress).lower() not in ("false", "0", "no")

    # ---- what TemplateLM needs ---------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eot_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def get_model_info(self) -> dict[str, Any]:
        c = self.model.config
        return {"model_num_parameters": self.model.num_params(), "s2hc_family": c.family, "s2hc_n_streams": c.n_streams,
                "s2hc_checkpoint": self.checkpoint}  # fmt: skip

    @torch.no_grad()
    def _logits(self, inputs: list[list[int]]) -> torch.Tensor:
        """Logits ``(B, T_max, vocab)`` of right-padded ``inputs`` (padding comes after, so it changes nothing)."""
        width = max(len(x) for x in inputs)
        batch = torch.zeros(len(inputs), width, dtype=torch.long)
        for i, x in enumerate(inputs):
            batch[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        return self.model(batch.to(self.device))

    def _pieces(self, context: list[int], continuation: list[int]) -> list[tuple[list[int], list[int]]]:
        """``(input ids, target ids)`` pieces that score ``continuation`` after ``context``, each input at most
        ``max_length`` long and its last positions predicting the targets: one piece (the context cut from
        the left) unless the continuation itself is longer than ``max_length``."""
        if not context or not continuation:
            raise ValueError("a loglikelihood request needs a non-empty context and continuation")
        sequence, begin, end = context + continuation, len(context), len(context) + len(continuation)
        pieces = []
        while end > begin:
            start = max(begin, end - self.max_length)
            pieces.append((sequence[max(0, end - 1 - self.max_length) : end - 1], sequence[start:end]))
            end = start
        return pieces[::-1]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), is_greedy)`` per ``((context, continuation), context_ids,
        continuation_ids)``: longest inputs first, in batches, results in the original order."""
        pieces = [(index, inp, target) for index, (_, context, continuation) in enumerate(requests)
                  for inp, target in self._pieces(context, continuation)]  # fmt: skip
        ordered = Collator(pieces, sort_fn=lambda piece: (-len(piece[1]), tuple(piece[1])))
        totals, greedy = [0.0] * len(requests), [True] * len(requests)
        bar = tqdm(total=len(pieces), disable=disable_tqdm or not self.progress, desc="s2hc loglikelihood")
        for chunk in ordered.get_batched(n=self.batch_size):
            logits = self._logits([inp for _, inp, _ in chunk])
            for (index, inp, target), row in zip(chunk, logits):
                scores = F.log_softmax(row[len(inp) - len(target) : len(inp)].float(), dim=-1)  # scored rows only
                wanted = torch.tensor(target, device=scores.device)
                totals[index] += float(scores.gather(-1, wanted[:, None]).sum())
                greedy[index] = greedy[index] and bool((scores.argmax(dim=-1) == wanted).all())
            bar.update(len(chunk))
        bar.close()
        results = list(zip(totals, greedy))
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole strings with lm-eval's disjoint rolling windows of ``max_length`` tokens."""
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            pieces = get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1,
            )  # fmt: skip
            for context, continuation in map(make_disjoint_window, pieces):
                windows.append((None, context, continuation))
                owners.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm or not self.progress)
        totals = [0.0] * len(requests)
        for index, (score, _) in zip(owners, scores):
            totals[index] += score
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first stop sequence (``until``, and always the end-of-text token)."""
        eot_text = self.tokenizer.decode([self.eot_token_id])
        ordered = Collator(
            [req.args for req in requests],
            sort_fn=lambda args: (-len(self.tok_encode(args[0])), args[0]),
            group_by="gen_kwargs",
            group_fn=lambda args: args[1],
        )
        results = []
        bar = tqdm(total=len(requests), disable=disable_tqdm or not self.progress, desc="s2hc generate_until")
        for chunk in ordered.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk)
            kwargs = dict(all_kwargs[0] or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            if eot_text not in until:
                until.append(eot_text)
            max_gen = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0) if kwargs.pop("do_sample", False) else 0.0
            if max_gen >= self.max_length:
                raise ValueError(f"max_gen_toks={max_gen} must be smaller than the context length {self.max_length}")
            prompts = [(self.tok_encode(c) or [self.eot_token_id])[-(self.max_length - max_gen) :] for c in contexts]

            def stopped(index: int, tokens: list[int], until=until) -> bool:  # bound: defined per request
                text = self.tokenizer.decode(tokens)
                return any(s and s in text for s in until)

            outputs = generate_tokens(
                self.model, prompts, max_gen, eot_id=self.eot_token_id, temperature=temperature,
                top_k=kwargs.pop("top_k", None), stop=stopped,
            )  # fmt: skip
            for context, gen_kwargs, tokens in zip(contexts, all_kwargs, outputs):
                text = self.tokenizer.decode(tokens)
                for stop in until:
                    if stop:
                        text = text.split(stop)[0]
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                bar.update(1)
        bar.close()
        return ordered.get_original(results)


def register() -> None:
    """Put ``S2HCLM`` in lm-eval's model registry under ``s2hc`` (done on import; safe to call again).

    A name already taken (say, by an lm-eval that read s2hc's ``lm_eval.models`` entry point as a lazy
    placeholder, which loads this same class) is left as it is."""
    if MODEL_NAME not in model_registry:
        register_model(MODEL_NAME)(S2HCLM)


register()
