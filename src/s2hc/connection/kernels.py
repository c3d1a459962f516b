"""Triton kernels for the hyper-connection's n-wide passes (``HyperConnection(kernels="triton")``).

For streams ``X`` ``(tokens, n, C)``, three autograd functions; the streams are read by each and written by
one, and no n-wide intermediate is stored:

- :func:`norm_project`: ``d = RMSNorm(vec X) W`` with the norm's weight folded into ``W`` ``(nC, K)``. One pass
  over ``X`` computes the sum of squares and the projection together (the DeepSeek mHC kernels' fold).
- :func:`read`: the branch input ``h = H_pre X`` in one pass over ``X``.
- :func:`write`: the new streams ``X' = H_res X + H_postᵀ F`` in one pass over ``X`` and ``F``: the mixing is
  done here, reading ``X`` again, rather than stored as ``M = H_res X`` by the read and read back.

The backward passes, for one connection (one :class:`Link` ties the three together): the write's backward reads
``dX'``, ``X`` and ``F`` for ``dF``, ``dH_post`` and ``dH_res``; the read's reads ``dh`` and ``X`` for ``dH_pre``;
the projection's, last (after the constraint map's backward has turned those into ``dd``), writes the one
``dX = H_resᵀ dX' + H_preᵀ dh + r dd Wᵀ − (r³/nC)(dd · XW) X``, and with it ``dW = Xᵀ (r dd)`` from the same
read of ``X`` (partial sums over token ranges, added in a fixed order: deterministic). The read's and the write's
backward hand ``dh`` and ``dX'`` to it through the link instead of writing their own n-wide parts of ``dX`` for
autograd to add. Without a link (or given other streams than the projection) each function's backward writes
its own part of ``dX``, as any autograd function; the values are the same.

Bytes each kernel moves: ``benchmarks/kernel_bytes.py`` (at n = 4, forward and backward together, 10n + 6 = 46
vectors of C per token, against a two-pass floor of 8n + 5 = 37; the layout this replaced moved 65).

The per-token constraint map between the kernels (gates, Cayley, Sinkhorn: tens of floats per token) stays in
PyTorch; under ``torch.compile`` inductor already emits Triton for it.

The mixing kernels run one program per token, looping over ``C`` in blocks; ``n`` is padded to a power of two.
From 16 padded streams on their mixing products are ``tl.dot`` with ``input_precision="ieee"`` (exact float32:
triton 3.6 turns the broadcast sums into TF32 tensor-core dots), below 16 broadcast sums. The projection and the
streams' gradient run over blocks of 16 tokens (``tl.dot`` in IEEE float32 over ``K``, and over tokens for
``dW``). ``benchmarks/aot_compile.py`` compiles every kernel for sm_90 and checks the SASS for tensor-core
instructions, and the registers, spills and shared memory. Accumulation is in float32 (float64 for float64
inputs, so ``torch.autograd.gradcheck`` applies); outputs are in the stream's dtype (``F``'s gradient in F's),
the matrices' gradients in theirs. Runs on CUDA tensors, or on CPU under Triton's interpreter
(``TRITON_INTERPRET=1`` set before ``triton`` is imported), which is how ``tests/test_triton_kernels.py`` checks
every kernel against the PyTorch reference. Importing this module needs ``triton`` (``pip install 's2hc[triton]'``).
"""

from __future__ import annotations

import torch

from ..extras import require

triton = require("triton", "kernels='triton'")
import triton.language as tl

__all__ = ["Link", "norm_project", "read", "write", "interpreted"]

# triton.jit reads TRITON_INTERPRET when it decorates a kernel, i.e. while this module is imported
_INTERPRETED = bool(triton.knobs.runtime.interpret)


def interpreted() -> bool:
    """Whether the kernels were built for Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return _INTERPRETED


def _acc_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _pow2(value: int) -> int:
    return max(2, triton.next_power_of_2(value))


class Link:
    """Ties one connection call's :func:`norm_project`, :func:`read` and :func:`write` together, so that their
    backward writes one ``dX``. Pass the same (fresh) link to the three, with the same streams; the projection's
    backward then runs after the other two (they take its ``marker`` output as an input) and adds their parts of
    ``dX``, which they hand over here (``grad_out`` and ``res`` from the write, ``grad_h`` and ``pre`` from the
    read) instead of returning them."""

    def __init__(self):
        self.marker: torch.Tensor | None = None  # the projection's zero-size output: an edge, for the order only
        self.streams: torch.Tensor | None = None  # the projection's (tokens, nC) streams
        self.n: int | None = None
        self.grad_out = self.res = self.grad_h = self.pre = None

    def joins(self, x: torch.Tensor) -> bool:
        """Whether ``x`` ``(tokens, n, C)`` (contiguous) are the streams the projection read, so that its backward
        can give their gradient; else the caller computes its own part of ``dX``."""
        s = self.streams
        return (s is not None and s.data_ptr() == x.data_ptr() and s.dtype == x.dtype and s.shape[0] == x.shape[0]
                and s.shape[1] == x.shape[1] * x.shape[2] and s.requires_grad == x.requires_grad)

    def take(self) -> tuple:
        """``(grad_out, res, grad_h, pre)`` as handed over (None where that backward has not run), and forget them."""
        parts = (self.grad_out, self.res, self.grad_h, self.pre)
        self.grad_out = self.res = self.grad_h = self.pre = None
        return parts


# ------------------------------------------------------------------ norm + projection (coefficient path)


@triton.jit
def _norm_project_fwd(
    x_ptr, w_ptr, d_ptr, inv_ptr, T, D, K, eps,
    ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # grid: (token blocks, column blocks); every column block recomputes its rows' sum of squares (K
    # exceeds one block only for large n), and the first one stores 1/rms
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < T, cols < K
    acc = tl.zeros((BLOCK_T, BLOCK_K), dtype=ACC)
    sum_sq = tl.zeros((BLOCK_T,), dtype=ACC)
    for start in range(0, D, BLOCK_D):
        feats = start + tl.arange(0, BLOCK_D)
        feat_ok = feats < D
        x = tl.load(x_ptr + rows[:, None] * D + feats[None, :], mask=row_ok[:, None] & feat_ok[None, :], other=0.0)
        x = x.to(ACC)
        w = tl.load(w_ptr + feats[:, None] * K + cols[None, :], mask=feat_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(x, w.to(ACC), input_precision="ieee")
        sum_sq += tl.sum(x * x, axis=1)
    inv_rms = 1.0 / tl.sqrt(sum_sq / D + eps)
    ok = row_ok[:, None] & col_ok[None, :]
    tl.store(d_ptr + rows[:, None] * K + cols[None, :], acc * inv_rms[:, None], mask=ok)
    if tl.program_id(1) == 0:
        tl.store(inv_ptr + rows, inv_rms, mask=row_ok)


def _project_blocks(k: int, wide_acc: bool) -> dict:
    """Blocks of :func:`_norm_project_fwd`: 16 tokens (tl.dot needs every tile dimension >= 16 on GPUs) x 64
    features x all of K up to 128 columns (a second column block would read X again: s2hc's and mhc's K at n = 8 are
    65 and 80), the features halved at 128 columns to keep W's tile at 16 KiB (float32; quartered in float64, which
    spilled 24 B with triton 3.6); beyond, 64-column blocks."""
    if k > 128:
        return dict(BLOCK_T=16, BLOCK_D=64, BLOCK_K=64)
    block_k = max(16, triton.next_power_of_2(k))
    return dict(BLOCK_T=16, BLOCK_D=(16 if wide_acc else 32) if block_k == 128 else 64, BLOCK_K=block_k)


# ------------------------------------------------------------------ the streams' gradient (and dW)


# T and N only bound loops and scale offsets (C keeps their alignment): specialising on them would only multiply builds
@triton.jit(do_not_specialize=["T", "N"])
def _streams_bwd(
    x_ptr, grad_out_ptr, res_ptr, grad_h_ptr, pre_ptr, g_ptr, coeff_ptr, w_ptr, grad_x_ptr, grad_w_ptr,
    T, N, C, K, SPLIT,
    ACC: tl.constexpr, MIX: tl.constexpr, READ: tl.constexpr, NORM: tl.constexpr, FUSE_DW: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # dX[t, j, c] = Σ_i H_res[t, i, j] dX'[t, i, c] (MIX) + H_pre[t, j] dh[t, c] (READ)
    #             + Σ_k g[t, k] W[jC + c, k] + coeff[t] X[t, j, c] (NORM; g = r dd, coeff = −(r³/nC)(dd · XW))
    # and with FUSE_DW the partial dW[jC + c, k] = Σ_t X[t, j, c] g[t, k] over this program's tokens.
    # grid: (C blocks, token ranges of SPLIT tokens); a program owns all n streams of its C block, so the mixing
    # over streams stays inside it, and loops over its tokens in blocks of BLOCK_T, so its part of dW stays in
    # registers (partial sums per token range, added by the caller: no atomics, the same result every run).
    BLOCK_F: tl.constexpr = BLOCK_N * BLOCK_C  # the projection's features (stream j, column c) of this program
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, BLOCK_N)
    c_ok, j_ok = c < C, j < N
    feat = tl.reshape(j[:, None] * C + c[None, :], (BLOCK_F,))
    feat_ok = tl.reshape(j_ok[:, None] & c_ok[None, :], (BLOCK_F,))
    k = tl.arange(0, BLOCK_K)
    if FUSE_DW:  # all of K in one block: W's tile is loaded once, and dW accumulates over the tokens
        w_t = tl.load(w_ptr + feat[None, :] * K + k[:, None], mask=feat_ok[None, :] & (k < K)[:, None], other=0.0)
        w_t = w_t.to(ACC)
        grad_w = tl.zeros((BLOCK_F, BLOCK_K), dtype=ACC)
    first = tl.program_id(1).to(tl.int64) * SPLIT
    last = tl.minimum(first + SPLIT, T)
    for t0 in range(first, last, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < last
        ok = t_ok[:, None, None] & j_ok[None, :, None] & c_ok[None, None, :]
        offsets = t[:, None, None] * N * C + j[None, :, None] * C + c[None, None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_N, BLOCK_C), dtype=ACC)
        if NORM:
            x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(ACC)
            coeff = tl.load(coeff_ptr + t, mask=t_ok, other=0.0).to(ACC)
            acc += coeff[:, None, None] * x
            if FUSE_DW:
                g = tl.load(g_ptr + t[:, None] * K + k[None, :], mask=t_ok[:, None] & (k < K)[None, :], other=0.0)
                g = g.to(ACC)
                acc += tl.reshape(tl.dot(g, w_t, input_precision="ieee"), (BLOCK_T, BLOCK_N, BLOCK_C))
                grad_w += tl.dot(tl.trans(tl.reshape(x, (BLOCK_T, BLOCK_F))), g, input_precision="ieee")
            else:
                for k0 in range(0, K, BLOCK_K):  # K in blocks (tl.dot tiles stay small); W from cache
                    kk = k0 + k
                    g = tl.load(g_ptr + t[:, None] * K + kk[None, :], mask=t_ok[:, None] & (kk < K)[None, :],
                                other=0.0)
                    w_t = tl.load(w_ptr + feat[None, :] * K + kk[:, None], mask=feat_ok[None, :] & (kk < K)[:, None],
                                  other=0.0)
                    product = tl.dot(g.to(ACC), w_t.to(ACC), input_precision="ieee")
                    acc += tl.reshape(product, (BLOCK_T, BLOCK_N, BLOCK_C))
        if READ:
            pre = tl.load(pre_ptr + t[:, None] * N + j[None, :], mask=t_ok[:, None] & j_ok[None, :], other=0.0)
            grad_h = tl.load(grad_h_ptr + t[:, None] * C + c[None, :], mask=t_ok[:, None] & c_ok[None, :], other=0.0)
            acc += pre.to(ACC)[:, :, None] * grad_h.to(ACC)[:, None, :]
        if MIX:
            for i in range(N):  # dX'[:, i] read once, into every output stream j
                res = tl.load(res_ptr + t[:, None] * N * N + i * N + j[None, :], mask=t_ok[:, None] & j_ok[None, :],
                              other=0.0)
                grad_out = tl.load(grad_out_ptr + t[:, None] * N * C + i * C + c[None, :],
                                   mask=t_ok[:, None] & c_ok[None, :], other=0.0)
                acc += res.to(ACC)[:, :, None] * grad_out.to(ACC)[:, None, :]
        tl.store(grad_x_ptr + offsets, acc.to(grad_x_ptr.dtype.element_ty), mask=ok)
    if FUSE_DW:
        rows = tl.program_id(1).to(tl.int64) * N * C * K + feat[:, None] * K + k[None, :]
        tl.store(grad_w_ptr + rows, grad_w, mask=feat_ok[:, None] & (k < K)[None, :])


_STREAMS_BLOCK_T = 16  # tl.dot's smallest tile, over tokens (dW) and as the rows of g Wᵀ
_STREAMS_PROGRAMS = 512  # C blocks x token ranges wanted at the least with a fused dW (an H200 has 132 SMs)


def _streams_blocks(n: int, k: int | None, fuse_dw: bool, wide_acc: bool) -> dict:
    """Blocks of :func:`_streams_bwd`: 16 tokens x all n (padded) streams x BLOCK_C columns, the projection's
    features of a program BLOCK_F = BLOCK_N·BLOCK_C = 64 (32 with a 128-column K, 16 with float64 accumulation; at
    least 16 for tl.dot), so that its three (16, BLOCK_F) tiles, W's (K, BLOCK_F) tile and dW's (BLOCK_F, K)
    accumulator fit in registers without spilling (sm_90, ``benchmarks/aot_compile.py``); with a fused dW all of K
    in one block, else 16."""
    block_n = _pow2(n)
    block_k = max(16, triton.next_power_of_2(k)) if k is not None and fuse_dw else 16
    block_f = 16 if wide_acc else 32 if block_k > 64 else 64
    return dict(BLOCK_T=_STREAMS_BLOCK_T, BLOCK_N=block_n, BLOCK_C=max(1, block_f // block_n), BLOCK_K=block_k)


def _fuses_dw(n: int, k: int, wide_acc: bool) -> bool:
    """Whether dW is formed in the streams' backward pass: K fits one tile of at most 128 columns and W's tile, held
    through the token loop beside dW's accumulator, has at most 4 096 entries (s2hc and mhc up to n = 8; at 64 padded
    streams only K up to 64); else dW is a GEMM over X (one more read of X)."""
    block_k = max(16, triton.next_power_of_2(k))
    block_f = _pow2(n) * _streams_blocks(n, k, True, wide_acc)["BLOCK_C"]
    return block_k <= 128 and block_f * block_k <= 4096


def _streams_backward(x, grad_out=None, res=None, grad_h=None, pre=None, g=None, coeff=None, weight=None,
                      want_dw: bool = False):
    """``dX`` ``(T, n, C)`` from the parts given (the mixing's ``grad_out``, ``res``; the read's ``grad_h``,
    ``pre``; the projection's ``g`` ``(T, K)``, ``coeff`` ``(T,)``, ``weight`` ``(nC, K)``), and with
    ``want_dw`` the projection's ``dW`` ``(nC, K)`` from the same pass: None when K does not fit it, or when the
    projection is alone (``HyperConnection.coefficients``' backward, not a connection call: a GEMM then)."""
    tokens, n, c = x.shape
    norm = g is not None
    k = weight.shape[1] if norm else 1
    coeff_dtype = weight.dtype if norm else (res if res is not None else pre).dtype
    wide_acc = torch.promote_types(x.dtype, coeff_dtype) == torch.float64
    fuse = norm and want_dw and (grad_out is not None or grad_h is not None) and _fuses_dw(n, k, wide_acc)
    blocks = _streams_blocks(n, k if norm else None, fuse, wide_acc)
    c_blocks = triton.cdiv(c, blocks["BLOCK_C"])
    token_blocks = triton.cdiv(tokens, blocks["BLOCK_T"])
    splits = min(token_blocks, triton.cdiv(_STREAMS_PROGRAMS, c_blocks)) if fuse else token_blocks
    split = triton.cdiv(token_blocks, splits) * blocks["BLOCK_T"]
    splits = triton.cdiv(tokens, split)
    acc = tl.float64 if wide_acc else tl.float32
    grad_x = torch.empty_like(x)
    partial = torch.empty(splits, n * c, k, dtype=coeff_dtype, device=x.device) if fuse else None
    # the parts not given: empty tensors of the dtypes they would have (one build whichever are given), never read
    none_wide, none_small = x.new_empty(0), torch.empty(0, dtype=coeff_dtype, device=x.device)

    def given(part, empty):
        return empty if part is None else part

    _streams_bwd[(c_blocks, splits)](
        x, given(grad_out, none_wide), given(res, none_small), given(grad_h, none_wide), given(pre, none_small),
        given(g, none_small), given(coeff, none_small), given(weight, none_small), grad_x,
        given(partial, none_small), tokens, n, c, k, split,
        ACC=acc, MIX=grad_out is not None, READ=grad_h is not None, NORM=norm, FUSE_DW=fuse, **blocks,
    )
    grad_w = None
    if fuse:
        grad_w = partial[0] if splits == 1 else partial.sum(0)
    return grad_x, grad_w


class _NormProject(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, link):
        tokens, width = x.shape
        k = weight.shape[1]
        d = torch.empty(tokens, k, dtype=weight.dtype, device=x.device)
        inv_rms = torch.empty(tokens, dtype=weight.dtype, device=x.device)
        blocks = _project_blocks(k, weight.dtype == torch.float64)
        grid = (triton.cdiv(tokens, blocks["BLOCK_T"]), triton.cdiv(k, blocks["BLOCK_K"]))
        _norm_project_fwd[grid](x, weight, d, inv_rms, tokens, width, k, eps, ACC=_acc_dtype(weight.dtype), **blocks)
        ctx.save_for_backward(x, weight, inv_rms, d)
        ctx.link = link
        ctx.set_materialize_grads(False)
        return d, x.new_empty(0)

    @staticmethod
    def backward(ctx, grad_d, _):
        x, weight, inv_rms, d = ctx.saved_tensors
        link = ctx.link
        grad_out, res, grad_h, pre = link.take() if link is not None else (None,) * 4
        tokens, width = x.shape
        grad_x = grad_weight = g = coeff = None
        if grad_d is not None:
            g = (grad_d * inv_rms.unsqueeze(-1)).contiguous()  # r dd: K floats per token, left to PyTorch
            # (r³/nC)(dd · XW) with XW = d / r
            coeff = (-(grad_d * d).sum(-1) * inv_rms.square() / width).contiguous()
        if ctx.needs_input_grad[0] and (g is not None or grad_out is not None or grad_h is not None):
            n = link.n if grad_out is not None or grad_h is not None else 1
            grad_x, grad_weight = _streams_backward(
                x.view(tokens, n, width // n), grad_out, res, grad_h, pre, g, coeff, weight,
                want_dw=ctx.needs_input_grad[1])
            grad_x = grad_x.view(tokens, width)
        if ctx.needs_input_grad[1] and grad_weight is None and g is not None:
            # (gᵀ X)ᵀ: for a skinny g this layout runs faster than Xᵀ g (docs/benchmarks.md 6b)
            grad_weight = (g.T @ x.to(g.dtype)).T
        return grad_x, grad_weight, None, None


def norm_project(x: torch.Tensor, weight: torch.Tensor, eps: float, link: Link | None = None) -> torch.Tensor:
    """``RMSNorm(x) @ weight`` for ``x`` ``(..., D)`` in any float dtype and ``weight`` ``(D, K)`` (the
    norm weight folded in, float32 or float64): ``(..., K)`` in weight's dtype. ``link``: see :class:`Link`
    (``x`` then the flattened streams ``(..., n·C)`` that :func:`read` and :func:`write` are given)."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    d, marker = _NormProject.apply(flat, weight.contiguous(), eps, link)
    if link is not None and link.marker is None:  # the first forward (a recomputation keeps the original)
        link.marker, link.streams = marker, flat
    return d.reshape(*lead, weight.shape[1])


# ---------------------------------------------------------------------------------- read


@triton.jit
def _read_fwd(x_ptr, pre_ptr, h_ptr, N, C, ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    n_ok = i < N
    pre = tl.load(pre_ptr + t * N + i, mask=n_ok, other=0.0).to(ACC)
    for start in range(0, C, BLOCK_C):
        c = start + tl.arange(0, BLOCK_C)
        c_ok = c < C
        x = tl.load(x_ptr + t * N * C + i[:, None] * C + c[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0)
        h = tl.sum(pre[:, None] * x.to(ACC), axis=0)
        tl.store(h_ptr + t * C + c, h.to(h_ptr.dtype.element_ty), mask=c_ok)


@triton.jit
def _read_bwd(x_ptr, grad_h_ptr, grad_pre_ptr, N, C, ACC: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_C: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    n_ok = i < N
    grad_pre = tl.zeros((BLOCK_N,), dtype=ACC)
    for start in range(0, C, BLOCK_C):
        c = start + tl.arange(0, BLOCK_C)
        c_ok = c < C
        x = tl.load(x_ptr + t * N * C + i[:, None] * C + c[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0)
        grad_h = tl.load(grad_h_ptr + t * C + c, mask=c_ok, other=0.0).to(ACC)
        grad_pre += tl.sum(x.to(ACC) * grad_h[None, :], axis=1)
    tl.store(grad_pre_ptr + t * N + i, grad_pre, mask=n_ok)


def _mix_blocks(n: int, c: int) -> dict:
    block_n = _pow2(n)
    if block_n < 16:  # (BLOCK_N, BLOCK_N, BLOCK_C) broadcast products live in registers: about 4 096 values
        return dict(BLOCK_N=block_n, BLOCK_C=min(_pow2(c), 4096 // (block_n * block_n)))
    return dict(BLOCK_N=block_n, BLOCK_C=16)  # tl.dot's smallest tile (a narrower C is masked)


def _mix_warps(n: int) -> int:
    """Warps of the write, forward and backward: at 64 padded streams the (n, n) matrix and the tiles took more
    than 64 registers per thread with 4 warps and spilled (sm_90, ``benchmarks/aot_compile.py``: the backward 84 B
    in fp32, the forward 160 B with bf16 streams); 8 warps keep both without a spill."""
    return 8 if _pow2(n) >= 64 else 4


def _joined(x: torch.Tensor, link: Link | None) -> Link | None:
    return link if link is not None and link.joins(x) else None


class _Read(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pre, marker, link):
        tokens, n, c = x.shape
        h = torch.empty(tokens, c, dtype=x.dtype, device=x.device)
        _read_fwd[(tokens,)](x, pre, h, n, c, ACC=_acc_dtype(x.dtype), **_mix_blocks(n, c))
        ctx.save_for_backward(x, pre)
        ctx.link = link
        return h

    @staticmethod
    def backward(ctx, grad_h):
        x, pre = ctx.saved_tensors
        tokens, n, c = x.shape
        grad_h = grad_h.contiguous()
        grad_x = grad_pre = None
        if ctx.needs_input_grad[1]:
            grad_pre = torch.empty_like(pre)
            _read_bwd[(tokens,)](
                x, grad_h, grad_pre, n, c, ACC=_acc_dtype(torch.promote_types(x.dtype, pre.dtype)),
                **_mix_blocks(n, c),
            )
        if ctx.link is not None:  # the projection's backward adds H_preᵀ dh into its dX
            ctx.link.grad_h, ctx.link.pre = grad_h, pre
        elif ctx.needs_input_grad[0]:
            grad_x = _streams_backward(x, grad_h=grad_h, pre=pre)[0]
        return grad_x, grad_pre, None, None


def read(x: torch.Tensor, pre: torch.Tensor, link: Link | None = None) -> torch.Tensor:
    """The branch input ``H_pre X`` ``(..., C)`` for streams ``x`` ``(..., n, C)`` and ``pre`` ``(..., n)`` (any
    float dtypes; accumulated in float32, float64 for float64 ``x``), in x's dtype. ``link``: :class:`Link`."""
    lead, (n, c) = x.shape[:-2], x.shape[-2:]
    flat = x.reshape(-1, n, c).contiguous()
    link = _joined(flat, link)
    if link is not None:
        link.n = n
    marker = link.marker if link is not None else None
    return _Read.apply(flat, pre.reshape(-1, n).contiguous(), marker, link).reshape(*lead, c)


# ---------------------------------------------------------------------------------------- write


@triton.jit
def _write_fwd(
    x_ptr, res_ptr, post_ptr, f_ptr, out_ptr, N, C,
    ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    n_ok = i < N
    post = tl.load(post_ptr + t * N + i, mask=n_ok, other=0.0).to(ACC)
    res = tl.load(res_ptr + t * N * N + i[:, None] * N + i[None, :], mask=n_ok[:, None] & n_ok[None, :], other=0.0)
    res = res.to(ACC)
    for start in range(0, C, BLOCK_C):
        c = start + tl.arange(0, BLOCK_C)
        c_ok = c < C
        ok = n_ok[:, None] & c_ok[None, :]
        offsets = t * N * C + i[:, None] * C + c[None, :]
        x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(ACC)  # (BLOCK_N, BLOCK_C): every stream, once
        if BLOCK_N >= 16:  # an explicit IEEE product: triton 3.6 made the broadcast sum a TF32 dot
            mixed = tl.dot(res, x, input_precision="ieee")
        else:  # tl.dot needs tiles of at least 16 x 16
            mixed = tl.sum(res[:, :, None] * x[None, :, :], axis=1)
        f = tl.load(f_ptr + t * C + c, mask=c_ok, other=0.0).to(ACC)
        tl.store(out_ptr + offsets, (mixed + post[:, None] * f[None, :]).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _write_bwd(
    grad_out_ptr, x_ptr, post_ptr, f_ptr, grad_post_ptr, grad_res_ptr, grad_f_ptr, N, C,
    ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    n_ok = i < N
    nn_ok = n_ok[:, None] & n_ok[None, :]
    post = tl.load(post_ptr + t * N + i, mask=n_ok, other=0.0).to(ACC)
    grad_post = tl.zeros((BLOCK_N,), dtype=ACC)
    grad_res = tl.zeros((BLOCK_N, BLOCK_N), dtype=ACC)
    for start in range(0, C, BLOCK_C):
        c = start + tl.arange(0, BLOCK_C)
        c_ok = c < C
        ok = n_ok[:, None] & c_ok[None, :]
        offsets = t * N * C + i[:, None] * C + c[None, :]
        grad_out = tl.load(grad_out_ptr + offsets, mask=ok, other=0.0).to(ACC)
        x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(ACC)
        f = tl.load(f_ptr + t * C + c, mask=c_ok, other=0.0).to(ACC)
        grad_f = tl.sum(post[:, None] * grad_out, axis=0)
        tl.store(grad_f_ptr + t * C + c, grad_f.to(grad_f_ptr.dtype.element_ty), mask=c_ok)
        grad_post += tl.sum(grad_out * f[None, :], axis=1)
        # dH_res += dX' Xᵀ: an IEEE dot from 16 x 16 tiles on, as the forward
        if BLOCK_N >= 16:
            grad_res += tl.dot(grad_out, tl.trans(x), input_precision="ieee")  # (no acc=: triton 3.6 types it fp32)
        else:
            grad_res += tl.sum(grad_out[:, None, :] * x[None, :, :], axis=2)
    tl.store(grad_post_ptr + t * N + i, grad_post, mask=n_ok)
    tl.store(grad_res_ptr + t * N * N + i[:, None] * N + i[None, :], grad_res, mask=nn_ok)


class _Write(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, res, post, f, marker, link):
        tokens, n, c = x.shape
        out = torch.empty_like(x)
        _write_fwd[(tokens,)](x, res, post, f, out, n, c, ACC=_acc_dtype(x.dtype), **_mix_blocks(n, c),
                              num_warps=_mix_warps(n))
        ctx.save_for_backward(x, res, post, f)
        ctx.link = link
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, res, post, f = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        tokens, n, c = x.shape
        grad_res, grad_post, grad_f = torch.empty_like(res), torch.empty_like(post), torch.empty_like(f)
        _write_bwd[(tokens,)](
            grad_out, x, post, f, grad_post, grad_res, grad_f, n, c,
            ACC=_acc_dtype(torch.promote_types(x.dtype, post.dtype)), **_mix_blocks(n, c),
            num_warps=_mix_warps(n),
        )
        grad_x = None
        if ctx.link is not None:  # the projection's backward adds H_resᵀ dX' into its dX
            ctx.link.grad_out, ctx.link.res = grad_out, res
        elif ctx.needs_input_grad[0]:
            grad_x = _streams_backward(x, grad_out=grad_out, res=res)[0]
        return grad_x, grad_res, grad_post, grad_f, None, None


def write(x: torch.Tensor, res: torch.Tensor, post: torch.Tensor, f: torch.Tensor,
          link: Link | None = None) -> torch.Tensor:
    """New streams ``H_res X + H_postᵀ F`` ``(..., n, C)`` in x's dtype, for streams ``x`` ``(..., n, C)``,
    ``res`` ``(..., n, n)``, ``post`` ``(..., n)`` and the branch output ``f`` ``(..., C)`` (any float dtypes;
    accumulated in float32, float64 for float64 ``x``). ``link``: :class:`Link`."""
    lead, (n, c) = x.shape[:-2], x.shape[-2:]
    flat = x.reshape(-1, n, c).contiguous()
    link = _joined(flat, link)
    if link is not None:
        link.n = n
    marker = link.marker if link is not None else None
    out = _Write.apply(flat, res.reshape(-1, n, n).contiguous(), post.reshape(-1, n).contiguous(),
                       f.reshape(-1, c).contiguous(), marker, link)
    return out.reshape(*lead, n, c)
