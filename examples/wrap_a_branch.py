"""Wrap any branch in a hyper-connection, switch the method with one string (the README's example)."""

import torch
from torch import nn

import s2hc

dim, n = 64, 4
mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
hc = s2hc.HyperConnection(dim, n_streams=n, family="s2hc", layer_index=0)  # or "mhc", "kromhc", ...

h = torch.randn(2, 16, dim)                 # (batch, time, dim) after the embedding
x = s2hc.expand_streams(h, n)               # (batch, time, n, dim): n copies
x = hc(x, mlp)                              # X' = H_res X + H_postᵀ mlp(H_pre X)
out = s2hc.reduce_streams(x)                # (batch, time, dim): sum over streams, before the final norm

H = hc.matrices(x)["res"]                   # (batch, time, n, n), float32
print(out.shape, "row sums", H.sum(-1).flatten()[:4].tolist(), "‖H‖₂ ≤", torch.linalg.matrix_norm(H, 2).max().item())
