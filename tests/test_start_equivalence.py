"""What docs/mixers.md says of the starts that equal the residual model: the wide residual computes its logits
exactly with the mean as reduction and only to the final norm's epsilon with the sum; AttnRes to the norms' epsilon,
which at the tiny preset's 1e-6 is far above float32 rounding."""

from __future__ import annotations

import torch

from s2hc.models import Transformer, get_preset


def _logits(family: str, n: int = 1, **overrides) -> torch.Tensor:
    model = Transformer(get_preset("tiny", family=family, n_streams=n, **overrides), init_rng="per_parameter",
                        init_seed=0).eval()
    ids = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids)


def test_the_wide_residual_is_exact_with_the_mean_and_not_with_the_sum():
    residual = _logits("residual")
    assert torch.equal(_logits("wide-residual", 4, stream_reduce="mean"), residual)
    gap = (_logits("wide-residual", 4, stream_reduce="sum") - residual).abs().max().item()
    assert 1e-4 < gap < 1e-2


def test_attn_res_starts_as_the_residual_model_up_to_the_norms_epsilon():
    residual = _logits("residual")
    block = (_logits("attn-res", family_options={"block_size": 2}) - residual).abs().max().item()
    full = (_logits("attn-res") - residual).abs().max().item()
    assert 1e-2 < block < full < 0.5  # the epsilon 1e-6 of the tiny preset is not negligible here
    tiny_eps = (_logits("attn-res", norm_eps=1e-12) - _logits("residual", norm_eps=1e-12)).abs().max().item()
    assert tiny_eps < 1e-5
