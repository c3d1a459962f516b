"""Triton kernels for the hyper-connection's n-wide passes (``HyperConnection(kernels="triton")``).

Three autograd functions, each a forward and a backward kernel, for streams ``X`` ``(tokens, n, C)``:

- :func:`norm_project`: ``d = RMSNorm(vec X) W`` with the norm's weight folded into ``W`` ``(nC, K)``.
  One pass over ``X`` computes the sum of squares and the projection together (the DeepSeek mHC
  kernels' fold); the backward pass writes ``dX = r dd Wᵀ − (r³/nC)(dd · XW) X`` in one pass, and ``dW``
  is one GEMM (``torch.matmul``, the library's GEMM is the right tool for ``Xᵀ dd``).
- :func:`read_mix`: ``(H_pre X, H_res X)`` in one pass over ``X``; backward ``dX = H_resᵀ dM + H_preᵀ dh``
  with ``dH_pre`` and ``dH_res`` reduced over ``C`` in the same pass.
- :func:`write`: ``M + H_postᵀ F``; backward ``dF`` and ``dH_post`` in one pass over ``dX'`` (``dM`` is
  ``dX'`` itself, no copy).

The per-token constraint map between them (gates, Cayley, Sinkhorn: tens of floats per token) stays in
PyTorch; under ``torch.compile`` inductor already emits Triton for it.

One program per block of tokens (projection) or per token (mixing), looping over ``C`` in blocks; ``n``
is padded to a power of two. From 16 padded streams on the mixing products are ``tl.dot`` with
``input_precision="ieee"`` (exact float32: triton 3.6 turns the broadcast sums into TF32 tensor-core dots), below
16 broadcast sums; ``benchmarks/aot_compile.py`` compiles every kernel for sm_90 and checks the SASS for tensor-core
instructions, and the registers, spills and shared memory. Accumulation is in float32 (float64 for float64 inputs, so
``torch.autograd.gradcheck`` applies); outputs are in the stream's dtype, the matrices' gradients in
theirs. Runs on CUDA tensors, or on CPU under Triton's interpreter (``TRITON_INTERPRET=1`` set before
``triton`` is imported), which is how ``tests/test_triton_kernels.py`` checks every kernel against the
PyTorch reference. Importing this module needs ``triton`` (``pip install 's2hc[triton]'``).
"""

from __future__ import annotations

import torch

from ..extras import require

triton = require("triton", "kernels='triton'")
import triton.language as tl

__all__ = ["norm_project", "read_mix", "write", "interpreted"]

# triton.jit reads TRITON_INTERPRET when it decorates a kernel, i.e. while this module is imported
_INTERPRETED = bool(triton.knobs.runtime.interpret)


def interpreted() -> bool:
    """Whether the kernels were built for Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return _INTERPRETED


def _acc_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _pow2(value: int) -> int:
    return max(2, triton.next_power_of_2(value))


# ------------------------------------------------------------------ norm + projection (coefficient path)


@triton.jit
def _norm_project_fwd(
    x_ptr, w_ptr, d_ptr, raw_ptr, inv_ptr, T, D, K, eps,
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
    out = rows[:, None] * K + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    tl.store(raw_ptr + out, acc, mask=ok)
    tl.store(d_ptr + out, acc * inv_rms[:, None], mask=ok)
    if tl.program_id(1) == 0:
        tl.store(inv_ptr + rows, inv_rms, mask=row_ok)


@triton.jit
def _norm_project_bwd(
    x_ptr, w_ptr, grad_raw_ptr, coeff_ptr, grad_x_ptr, T, D, K,
    ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    coeff = tl.load(coeff_ptr + rows, mask=row_ok, other=0.0)
    for start in range(0, D, BLOCK_D):
        feats = start + tl.arange(0, BLOCK_D)
        feat_ok = feats < D
        ok = row_ok[:, None] & feat_ok[None, :]
        offsets = rows[:, None] * D + feats[None, :]
        grad_x = coeff[:, None] * tl.load(x_ptr + offsets, mask=ok, other=0.0).to(ACC)
        for k_start in range(0, K, BLOCK_K):  # dX += r dd Wᵀ, K in blocks (tl.dot tiles stay small)
            cols = k_start + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            rk_ok = row_ok[:, None] & col_ok[None, :]
            grad_raw = tl.load(grad_raw_ptr + rows[:, None] * K + cols[None, :], mask=rk_ok, other=0.0)
            kd_ok = col_ok[:, None] & feat_ok[None, :]
            w_t = tl.load(w_ptr + feats[None, :] * K + cols[:, None], mask=kd_ok, other=0.0)
            grad_x += tl.dot(grad_raw.to(ACC), w_t.to(ACC), input_precision="ieee")
        tl.store(grad_x_ptr + offsets, grad_x.to(grad_x_ptr.dtype.element_ty), mask=ok)


# tl.dot needs every tile dimension >= 16 on GPUs; 64 columns keep the weight tile at 16 KiB (float32)
_PROJECT_BLOCKS = dict(BLOCK_T=16, BLOCK_D=64)


def _column_block(k: int) -> int:
    return min(max(16, triton.next_power_of_2(k)), 64)


def _backward_column_block(k: int) -> int:
    """The backward's K block: with K not a multiple of 16 the transposed weight tile's loads cannot be
    vectorised, and 64 columns of them take 190-255 registers per thread and spill (K = 65: s2hc at
    n = 8, checked by ``benchmarks/aot_compile.py``); 16 columns keep it at about 100."""
    return 16 if k % 16 else _column_block(k)


class _NormProject(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        tokens, width = x.shape
        k = weight.shape[1]
        d = torch.empty(tokens, k, dtype=weight.dtype, device=x.device)
        raw, inv_rms = torch.empty_like(d), torch.empty(tokens, dtype=weight.dtype, device=x.device)
        block_k = _column_block(k)
        grid = (triton.cdiv(tokens, _PROJECT_BLOCKS["BLOCK_T"]), triton.cdiv(k, block_k))
        _norm_project_fwd[grid](
            x, weight, d, raw, inv_rms, tokens, width, k, eps,
            ACC=_acc_dtype(weight.dtype), BLOCK_K=block_k, **_PROJECT_BLOCKS,
        )
        ctx.save_for_backward(x, weight, inv_rms, raw)
        return d

    @staticmethod
    def backward(ctx, grad_d):
        x, weight, inv_rms, raw = ctx.saved_tensors
        tokens, width = x.shape
        k = weight.shape[1]
        grad_raw = (grad_d * inv_rms.unsqueeze(-1)).contiguous()  # K floats per token: left to PyTorch
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            coeff = (-(grad_d * raw).sum(-1) * inv_rms.pow(3) / width).contiguous()
            grad_x = torch.empty_like(x)
            grid = (triton.cdiv(tokens, _PROJECT_BLOCKS["BLOCK_T"]),)
            _norm_project_bwd[grid](
                x, weight, grad_raw, coeff, grad_x, tokens, width, k,
                ACC=_acc_dtype(weight.dtype), BLOCK_K=_backward_column_block(k), **_PROJECT_BLOCKS,
            )
        if ctx.needs_input_grad[1]:
            grad_weight = x.to(grad_raw.dtype).T @ grad_raw
        return grad_x, grad_weight, None


def norm_project(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm(x) @ weight`` for ``x`` ``(..., D)`` in any float dtype and ``weight`` ``(D, K)`` (the
    norm weight folded in, float32 or float64): ``(..., K)`` in weight's dtype."""
    lead = x.shape[:-1]
    d = _NormProject.apply(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous(), eps)
    return d.reshape(*lead, weight.shape[1])


# ---------------------------------------------------------------------------------- read and mix


@triton.jit
def _read_mix_fwd(
    x_ptr, pre_ptr, res_ptr, h_ptr, mixed_ptr, N, C,
    ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    n_ok = i < N
    pre = tl.load(pre_ptr + t * N + i, mask=n_ok, other=0.0).to(ACC)
    res = tl.load(res_ptr + t * N * N + i[:, None] * N + i[None, :], mask=n_ok[:, None] & n_ok[None, :], other=0.0)
    res = res.to(ACC)
    for start in range(0, C, BLOCK_C):
        c = start + tl.arange(0, BLOCK_C)
        c_ok = c < C
        ok = n_ok[:, None] & c_ok[None, :]
        offsets = t * N * C + i[:, None] * C + c[None, :]
        x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(ACC)  # (BLOCK_N, BLOCK_C): every stream, once
        h = tl.sum(pre[:, None] * x, axis=0)
        if BLOCK_N >= 16:  # an explicit IEEE product: triton 3.6 made the broadcast sum a TF32 dot
            mixed = tl.dot(res, x, input_precision="ieee")
        else:  # tl.dot needs tiles of at least 16 x 16
            mixed = tl.sum(res[:, :, None] * x[None, :, :], axis=1)
        tl.store(h_ptr + t * C + c, h.to(h_ptr.dtype.element_ty), mask=c_ok)
        tl.store(mixed_ptr + offsets, mixed.to(mixed_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _read_mix_bwd(
    x_ptr, pre_ptr, res_ptr, grad_h_ptr, grad_m_ptr, grad_x_ptr, grad_pre_ptr, grad_res_ptr, N, C,
    ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    n_ok = i < N
    nn_ok = n_ok[:, None] & n_ok[None, :]
    nn_offsets = t * N * N + i[:, None] * N + i[None, :]
    pre = tl.load(pre_ptr + t * N + i, mask=n_ok, other=0.0).to(ACC)
    res = tl.load(res_ptr + nn_offsets, mask=nn_ok, other=0.0).to(ACC)
    grad_pre = tl.zeros((BLOCK_N,), dtype=ACC)
    grad_res = tl.zeros((BLOCK_N, BLOCK_N), dtype=ACC)
    for start in range(0, C, BLOCK_C):
        c = start + tl.arange(0, BLOCK_C)
        c_ok = c < C
        ok = n_ok[:, None] & c_ok[None, :]
        offsets = t * N * C + i[:, None] * C + c[None, :]
        x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(ACC)
        grad_m = tl.load(grad_m_ptr + offsets, mask=ok, other=0.0).to(ACC)
        grad_h = tl.load(grad_h_ptr + t * C + c, mask=c_ok, other=0.0).to(ACC)
        # dX[j] = Σ_i H_res[i, j] dM[i] + H_pre[j] dh, dH_res += dM Xᵀ: IEEE dots from 16 x 16 tiles on, as forward
        if BLOCK_N >= 16:
            grad_x = tl.dot(tl.trans(res), grad_m, input_precision="ieee")
            grad_res += tl.dot(grad_m, tl.trans(x), input_precision="ieee")  # (no acc=: triton 3.6 types it fp32)
        else:
            grad_x = tl.sum(res[:, :, None] * grad_m[:, None, :], axis=0)
            grad_res += tl.sum(grad_m[:, None, :] * x[None, :, :], axis=2)
        grad_x += pre[:, None] * grad_h[None, :]
        tl.store(grad_x_ptr + offsets, grad_x.to(grad_x_ptr.dtype.element_ty), mask=ok)
        grad_pre += tl.sum(x * grad_h[None, :], axis=1)
    tl.store(grad_pre_ptr + t * N + i, grad_pre, mask=n_ok)
    tl.store(grad_res_ptr + nn_offsets, grad_res, mask=nn_ok)


def _mix_blocks(n: int, c: int) -> dict:
    block_n = _pow2(n)
    if block_n < 16:  # (BLOCK_N, BLOCK_N, BLOCK_C) broadcast products live in registers: about 4 096 values
        return dict(BLOCK_N=block_n, BLOCK_C=min(_pow2(c), 4096 // (block_n * block_n)))
    return dict(BLOCK_N=block_n, BLOCK_C=16)  # tl.dot's smallest tile (a narrower C is masked)


def _mix_backward_warps(n: int) -> int:
    """Warps of the read/mix backward: at 64 padded streams its two (n, n) matrices take 64 registers per
    thread with 4 warps and it spilled (sm_90: 20 KiB per thread before the tl.dot forms, 84 B after); 8 keep it
    at about 190 registers and no spill, float64 included (``benchmarks/aot_compile.py``)."""
    return 8 if _pow2(n) >= 64 else 4


class _ReadMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pre, res):
        tokens, n, c = x.shape
        h = torch.empty(tokens, c, dtype=x.dtype, device=x.device)
        mixed = torch.empty_like(x)
        _read_mix_fwd[(tokens,)](x, pre, res, h, mixed, n, c, ACC=_acc_dtype(x.dtype), **_mix_blocks(n, c))
        ctx.save_for_backward(x, pre, res)
        return h, mixed

    @staticmethod
    def backward(ctx, grad_h, grad_m):
        x, pre, res = ctx.saved_tensors
        tokens, n, c = x.shape
        grad_h = torch.zeros_like(x[:, 0]) if grad_h is None else grad_h.contiguous()
        grad_m = torch.zeros_like(x) if grad_m is None else grad_m.contiguous()
        grad_x = torch.empty_like(x)
        grad_pre, grad_res = torch.empty_like(pre), torch.empty_like(res)
        _read_mix_bwd[(tokens,)](
            x, pre, res, grad_h, grad_m, grad_x, grad_pre, grad_res, n, c,
            ACC=_acc_dtype(torch.promote_types(x.dtype, pre.dtype)), **_mix_blocks(n, c),
            num_warps=_mix_backward_warps(n),
        )
        return grad_x, grad_pre, grad_res


def read_mix(x: torch.Tensor, pre: torch.Tensor, res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(H_pre X (..., C), H_res X (..., n, C))`` for streams ``x`` ``(..., n, C)``, ``pre`` ``(..., n)``,
    ``res`` ``(..., n, n)`` (any float dtypes; products accumulate in float32, float64 for float64 ``x``)."""
    lead, (n, c) = x.shape[:-2], x.shape[-2:]
    h, mixed = _ReadMix.apply(
        x.reshape(-1, n, c).contiguous(), pre.reshape(-1, n).contiguous(), res.reshape(-1, n, n).contiguous()
    )
    return h.reshape(*lead, c), mixed.reshape(*lead, n, c)


# ---------------------------------------------------------------------------------------- write


@triton.jit
def _write_fwd(
    mixed_ptr, post_ptr, f_ptr, out_ptr, N, C,
    ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    n_ok = i < N
    post = tl.load(post_ptr + t * N + i, mask=n_ok, other=0.0).to(ACC)
    for start in range(0, C, BLOCK_C):
        c = start + tl.arange(0, BLOCK_C)
        c_ok = c < C
        ok = n_ok[:, None] & c_ok[None, :]
        offsets = t * N * C + i[:, None] * C + c[None, :]
        mixed = tl.load(mixed_ptr + offsets, mask=ok, other=0.0).to(ACC)
        f = tl.load(f_ptr + t * C + c, mask=c_ok, other=0.0).to(ACC)
        tl.store(out_ptr + offsets, (mixed + post[:, None] * f[None, :]).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _write_bwd(
    grad_out_ptr, post_ptr, f_ptr, grad_post_ptr, grad_f_ptr, N, C,
    ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    n_ok = i < N
    post = tl.load(post_ptr + t * N + i, mask=n_ok, other=0.0).to(ACC)
    grad_post = tl.zeros((BLOCK_N,), dtype=ACC)
    for start in range(0, C, BLOCK_C):
        c = start + tl.arange(0, BLOCK_C)
        c_ok = c < C
        ok = n_ok[:, None] & c_ok[None, :]
        grad_out = tl.load(grad_out_ptr + t * N * C + i[:, None] * C + c[None, :], mask=ok, other=0.0).to(ACC)
        f = tl.load(f_ptr + t * C + c, mask=c_ok, other=0.0).to(ACC)
        grad_f = tl.sum(post[:, None] * grad_out, axis=0)
        tl.store(grad_f_ptr + t * C + c, grad_f.to(grad_f_ptr.dtype.element_ty), mask=c_ok)
        grad_post += tl.sum(grad_out * f[None, :], axis=1)
    tl.store(grad_post_ptr + t * N + i, grad_post, mask=n_ok)


class _Write(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mixed, post, f):
        tokens, n, c = mixed.shape
        out = torch.empty_like(mixed)
        _write_fwd[(tokens,)](mixed, post, f, out, n, c, ACC=_acc_dtype(mixed.dtype), **_mix_blocks(n, c))
        ctx.save_for_backward(post, f)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        post, f = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        tokens, n, c = grad_out.shape
        grad_post, grad_f = torch.empty_like(post), torch.empty_like(f)
        _write_bwd[(tokens,)](
            grad_out, post, f, grad_post, grad_f, n, c,
            ACC=_acc_dtype(torch.promote_types(f.dtype, post.dtype)), **_mix_blocks(n, c),
        )
        return grad_out, grad_post, grad_f


def write(mixed: torch.Tensor, post: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """New streams ``M + H_postᵀ F`` for ``mixed`` ``(..., n, C)``, ``post`` ``(..., n)``, branch output ``f``
    ``(..., C)``: ``(..., n, C)`` in mixed's dtype."""
    lead, (n, c) = mixed.shape[:-2], mixed.shape[-2:]
    flat = (mixed.reshape(-1, n, c).contiguous(), post.reshape(-1, n).contiguous(), f.reshape(-1, c).contiguous())
    return _Write.apply(*flat).reshape(*lead, n, c)
