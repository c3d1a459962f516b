"""Text generation with an s2hc :class:`~s2hc.models.Transformer`: batched, left-padded, with a KV cache.

>>> import torch
>>> from s2hc.models import Transformer, get_preset
>>> model = Transformer(get_preset("tiny", n_layers=1, dim=32, n_heads=2, family="s2hc", n_streams=2)).eval()
>>> out = generate_tokens(model, [[1, 2, 3], [4, 5]], max_new_tokens=4)
>>> [len(o) for o in out]
[4, 4]
>>> out == generate_tokens(model, [[1, 2, 3], [4, 5]], max_new_tokens=4, use_cache=False)
True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..checks import check_int
from ..models.transformer import KVCache


def _check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    if not prompts:
        raise ValueError("no prompts given")
    out = []
    for prompt in prompts:
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("every prompt needs at least one token (give the end-of-text id for an empty prompt)")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {vocab_size}), got {min(prompt)}..{max(prompt)}")
        out.append(prompt)
    return out


def _next_tokens(logits: torch.Tensor, temperature: float, top_k: int | None, generator) -> torch.Tensor:
    """Greedy (``temperature == 0``) or sampled next tokens from the last-position ``logits`` ``(B, V)``."""
    logits = logits.float()
    if bool(torch.isnan(logits).any()):
        raise ValueError("the model's next-token logits are NaN: its weights or activations are not finite, so "
                         "nothing can be generated from it; check the checkpoint")
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_tokens(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eot_id: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    stop: Callable[[int, list[int]], bool] | None = None,
) -> list[list[int]]:
    """The new tokens of each prompt (lists of ids, at most ``max_new_tokens`` each).

    Prompts of different lengths are left-padded into one batch (padding is masked and positions start at
    each prompt's first token, so a prompt gets the tokens it would get alone). A prompt is cut from the
    left to fit ``max_seq_len - max_new_tokens`` positions. A sequence stops after ``eot_id`` (included in its
    output) or when ``stop(index, new_tokens)`` returns True; generation ends when every sequence has stopped.
    ``temperature == 0`` is greedy; otherwise sampling from ``softmax(logits / temperature)`` restricted to
    the ``top_k`` most likely tokens. ``use_cache=False`` recomputes the whole sequence at every step (the
    same tokens, slower: kept for checking the cache).
    """
    config = model.config
    check_int("max_new_tokens", max_new_tokens)
    if max_new_tokens >= config.max_seq_len:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in max_seq_len={config.max_seq_len}"
        )
    prompts = [p[-(config.max_seq_len - max_new_tokens) :] for p in _check_prompts(prompts, config.vocab_size)]
    device = next(model.parameters()).device
    B, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, width, dtype=torch.long, device=device)
    mask = torch.zeros(B, width, dtype=torch.long, device=device)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt) :] = torch.tensor(prompt, device=device)
        mask[b, width - len(prompt) :] = 1
    padded = bool((mask == 0).any())
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    outputs: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    cache = KVCache() if use_cache else None
    inputs, step_positions = ids, positions
    for _ in range(max_new_tokens):
        if cache is not None:
            logits = model(inputs, cache=cache, attention_mask=mask, position_ids=step_positions)
        elif padded:
            logits = model(ids, attention_mask=mask, position_ids=positions)
        else:
            logits = model(ids)
        token = _next_tokens(logits[:, -1], temperature, top_k, generator)
        for b in range(B):
            if not done[b]:
                outputs[b].append(int(token[b]))
                if (eot_id is not None and int(token[b]) == eot_id) or (stop is not None and stop(b, outputs[b])):
                    done[b] = True
        if all(done):
            break
        step_positions = positions[:, -1:] + 1
        inputs = token[:, None]
        ids = torch.cat((ids, inputs), dim=1)
        mask = torch.cat((mask, torch.ones_like(inputs)), dim=1)
        positions = torch.cat((positions, step_positions), dim=1)
    return outputs
