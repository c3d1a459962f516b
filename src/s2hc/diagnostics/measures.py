"""One function per measurement of docs/design.md section 2, on tensors.

Every function takes residual matrices ``H`` of shape ``(..., n, n)`` (any leading batch dimensions: layers,
tokens, ...) or a stack over depth ``Hs`` ``(L, ..., n, n)``, and computes in float64 (float32 matrices are
promoted first, so the measurement itself adds no rounding worth speaking of). Results are float64 tensors
whose shapes are given in each docstring. Conventions:

- ``H`` acts on the streams from the left, as in the model: ``X' = H X`` with ``X ∈ R^{n×C}``. A row of ``H``
  says what one output stream reads, a column where one input stream goes.
- Over depth the composite after ``l + 1`` matrices is ``P_l = H_l ⋯ H_1 H_0`` (the residual path from the
  first connection's input to the output of connection ``l``).
- Stream usage (:func:`stream_shares`, :func:`mean_shares`, :func:`effective_streams`, :func:`dominant_stream`,
  :func:`stream_norms`) takes per-stream weights or amounts ``(..., n)`` (``H_pre``, ``H_post``, what the final
  read takes from each stream) rather than matrices.

>>> import torch
>>> swap = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
>>> spectral_norm(swap).item(), identity_distance(swap).item() ** 2
(1.0, 4.0)
>>> rotation_angle(swap).item()  # the swap flips the one direction of difference (x₁ − x₂ -> x₂ − x₁)
180.0
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..mixers.orthomaps import helmert_basis

__all__ = [
    "NEGATIVE_TOLERANCE",
    "AmaxGain",
    "Dominant",
    "SumError",
    "amax_gain",
    "column_sums",
    "common_mode_gain",
    "composite_product",
    "cumulative_column_sums",
    "deviation_block",
    "deviation_singular_values",
    "dominant_stream",
    "effective_streams",
    "identity_distance",
    "mean_shares",
    "negative_share",
    "rotation_angle",
    "row_col_sum_error",
    "row_sums",
    "spectral_norm",
    "spectrum_slope",
    "stream_norms",
    "stream_shares",
    "stream_similarity",
]

#: What :func:`negative_share` counts as negative: entries below −1e-3. An entry above that subtracts less than
#: 0.1 % of a stream, which is no mixing worth the word. In the committed study's s²HC models the first and last
#: connections, whose rotations get no gradient but float32 rounding noise (:mod:`s2hc.diagnostics.inert`),
#: moved from their initialisation (no negative entry) to entries of −1e-5 to −3e-3, while the trained interior
#: connections reach −0.5; counting every ``x < 0`` called 31 % of those near-identity matrices "negative".
NEGATIVE_TOLERANCE = 1e-3


def _matrices(H: torch.Tensor, name: str = "H") -> torch.Tensor:
    if not isinstance(H, torch.Tensor) or H.dim() < 2 or H.shape[-1] != H.shape[-2]:
        shape = tuple(H.shape) if isinstance(H, torch.Tensor) else type(H).__name__
        raise ValueError(f"{name} must be a tensor of square matrices (..., n, n), got {shape}")
    return H.detach().to(torch.promote_types(H.dtype, torch.float64))


class SumError(NamedTuple):
    """Largest deviation of a row sum (``row``) and of a column sum (``col``) from 1, each ``(...)``."""

    row: torch.Tensor
    col: torch.Tensor


class AmaxGain(NamedTuple):
    """mHC's gains of one matrix, each ``(...)``: ``forward`` = max_i |Σ_j H_ij|, ``backward`` = max_j |Σ_i H_ij|."""

    forward: torch.Tensor
    backward: torch.Tensor


def row_sums(H: torch.Tensor) -> torch.Tensor:
    """``H 1``: ``(..., n, n) -> (..., n)``. 1 everywhere means a feature shared by all streams passes unchanged."""
    return _matrices(H).sum(dim=-1)


def column_sums(H: torch.Tensor) -> torch.Tensor:
    """``1ᵀ H``: ``(..., n, n) -> (..., n)``. 1 everywhere means the sum (mean) over streams is preserved."""
    return _matrices(H).sum(dim=-2)


def common_mode_gain(H: torch.Tensor) -> torch.Tensor:
    """``1ᵀ H 1 / n``: ``(..., n, n) -> (...)``, the mean of the row sums (equally of the column sums).

    What ``H`` does to a feature all streams share, on average: 1 for every mean-preserving family (s²HC, mHC
    up to its Sinkhorn error, the identity); above 1, ``H`` amplifies the common part of the residual path (what
    an unconstrained HC can learn and a mean-preserving constraint forbids), below 1 it attenuates it.

    >>> common_mode_gain(torch.tensor([[1.0, 0.5], [0.0, 1.0]])).item()
    1.25
    """
    H = _matrices(H)
    return H.sum(dim=(-1, -2)) / H.shape[-1]


def row_col_sum_error(H: torch.Tensor) -> SumError:
    """``(max_i |Σ_j H_ij − 1|, max_j |Σ_i H_ij − 1|)`` per matrix: ``(..., n, n) -> ((...), (...))``.

    Zero for a doubly stochastic matrix (both) or an mHC Sinkhorn output (rows only, after its last row
    normalisation); for s²HC both are zero by construction.
    """
    H = _matrices(H)
    return SumError((H.sum(-1) - 1).abs().amax(-1), (H.sum(-2) - 1).abs().amax(-1))


def spectral_norm(H: torch.Tensor) -> torch.Tensor:
    """Largest singular value ``‖H‖₂``: ``(..., n, n) -> (...)``. Above 1 means some direction is amplified."""
    return torch.linalg.matrix_norm(_matrices(H), ord=2)


def deviation_block(H: torch.Tensor) -> torch.Tensor:
    """``U_Zᵀ H U_Z``: ``(..., n, n) -> (..., n−1, n−1)``, ``U_Z`` the truncated Helmert basis of the zero-sum subspace.

    This is what ``H`` does to the differences between streams (the part orthogonal to their mean); for s²HC it
    is the core ``U_core diag(s) V_coreᵀ``. For a matrix that does not preserve the mean it is still the
    compression of ``H`` onto that subspace (the leak between mean and deviations is not in it).
    """
    H = _matrices(H)
    basis = helmert_basis(H.shape[-1], H.dtype).to(H.device)
    return basis.T @ H @ basis


def deviation_singular_values(H: torch.Tensor) -> torch.Tensor:
    """Singular values of :func:`deviation_block`, descending: ``(..., n, n) -> (..., n−1)``.

    s²HC Fig. 5 plots these per layer (trained Qwen3: two near 1, the smallest ≈ 0.77). 1 keeps a direction
    of difference between streams, below 1 attenuates it, 0 erases it (streams pulled to their mean).
    """
    block = deviation_block(H)
    if block.shape[-1] == 0:
        return block.new_zeros(block.shape[:-1])
    return torch.linalg.svdvals(block)


def identity_distance(H: torch.Tensor) -> torch.Tensor:
    """Frobenius distance from the identity ``‖H − I‖_F``: ``(..., n, n) -> (...)``. 0 means no mixing at all."""
    H = _matrices(H)
    eye = torch.eye(H.shape[-1], dtype=H.dtype, device=H.device)
    return torch.linalg.matrix_norm(H - eye, ord="fro")


def negative_share(H: torch.Tensor, tolerance: float = NEGATIVE_TOLERANCE) -> torch.Tensor:
    """Fraction of the ``n²`` entries below ``−tolerance``: ``(..., n, n) -> (...)``, in ``[0, 1]``.

    ``tolerance`` (default :data:`NEGATIVE_TOLERANCE`, 1e-3) keeps entries that are zero but for rounding or an
    untrained initialisation out of the count; 0 counts every ``x < 0``. Always 0 for the doubly stochastic
    families (mhc, mhc-lite, kromhc); s²HC may subtract one stream from another, so a positive share there is
    expected, not an error. It cannot say how much is subtracted (``min_entry`` does) nor whether the matrix
    rotates (:func:`rotation_angle` does).
    """
    if not isinstance(tolerance, (int, float)) or isinstance(tolerance, bool) or not tolerance >= 0:
        raise ValueError(f"tolerance must be a number >= 0, got {tolerance!r}")
    H = _matrices(H)
    return (-tolerance > H).to(H.dtype).mean(dim=(-1, -2))


def rotation_angle(H: torch.Tensor) -> torch.Tensor:
    """The largest angle, in degrees, by which ``H`` turns a direction of difference between streams: ``(..., n, n)
    -> (...)`` in ``[0, 180]``.

    ``Q = U Vᵀ`` is the orthogonal polar factor of the :func:`deviation_block` ``M = U_Zᵀ H U_Z = U Σ Vᵀ`` (the
    rotation left when the stretch ``Σ`` is taken out), and the angle is ``max |arg λ|`` over ``Q``'s eigenvalues
    ``λ`` (they lie on the unit circle): a rotation by θ in one plane gives θ, a flip (reflection) 180°, ``H = I``
    (and any ``M`` with ``U = V``, a pure stretch) 0. For s²HC, ``H = J + U_Z U diag(s) Vᵀ U_Zᵀ``, so ``M = U
    diag(s) Vᵀ`` and the angle is that of its rotations ``U Vᵀ`` whatever the spectrum ``s > 0`` is: it shows what
    the deviation singular values (1 for every rotation) cannot. With ``n = 1`` there is no difference to turn: 0.
    When a singular value of ``M`` is 0 the polar factor is not unique (a direction erased has no angle): read
    the angle beside :func:`deviation_singular_values`.
    """
    block = deviation_block(H)
    if block.shape[-1] == 0:
        return block.new_zeros(block.shape[:-2])
    U, _, Vh = torch.linalg.svd(block)
    eigenvalues = torch.linalg.eigvals(U @ Vh)
    return torch.rad2deg(eigenvalues.angle().abs().amax(dim=-1))


def spectrum_slope(H: torch.Tensor) -> torch.Tensor:
    """``1 − σ²`` of each deviation singular value σ (:func:`deviation_singular_values`, descending σ): ``(..., n, n)
    -> (..., n−1)``.

    For s²HC, whose spectrum is ``s = tanh(a)``, this is exactly tanh's slope ``1 − tanh²(a)`` at the
    pre-activation: how much the spectrum can still learn. Its initial bias 4 gives 1.3e-3 (saturated: the
    gradient reaching ``a`` is scaled by that much). For any other family it is how far the deviation block is
    from an isometry: 0 keeps a direction's length, 1 erases it, below 0 amplifies it. It cannot see rotations
    (:func:`rotation_angle` does).
    """
    return 1 - deviation_singular_values(H).square()


def composite_product(Hs: torch.Tensor) -> torch.Tensor:
    """Running products over depth: ``Hs`` ``(L, ..., n, n)`` -> ``P`` ``(L, ..., n, n)``, ``P_l = H_l ⋯ H_0``.

    Per token (the leading dimensions after ``L`` are kept), so each token's own matrices are composed.
    ``P_{L−1}`` is the whole residual path through the ``L`` connections.
    """
    Hs = _matrices(Hs, "Hs")
    if Hs.dim() < 3:
        raise ValueError(f"Hs must stack matrices over depth, shape (L, ..., n, n), got {tuple(Hs.shape)}")
    products = [Hs[0]]
    for H in Hs[1:]:
        products.append(H @ products[-1])
    return torch.stack(products)


def amax_gain(H: torch.Tensor) -> AmaxGain:
    """mHC's Amax gain magnitudes of each matrix: ``(..., n, n) -> AmaxGain((...), (...))``.

    ``forward`` is the largest absolute row sum ``max_i |Σ_j H_ij|`` (the gain of a signal shared by all streams
    going forward), ``backward`` the largest absolute column sum ``max_j |Σ_i H_ij|`` (the same for gradients
    going back). These are absolute values of sums, as mHC defines them, not the ∞/1-norms ``Σ_j |H_ij|``; for
    non-negative matrices the two coincide. Apply to :func:`composite_product` for mHC Fig. 3 (b)
    (HC ≈ 3000 at 27 B, mHC ≈ 1.6).
    """
    H = _matrices(H)
    return AmaxGain(H.sum(-1).abs().amax(-1), H.sum(-2).abs().amax(-1))


def cumulative_column_sums(Hs: torch.Tensor) -> torch.Tensor:
    """Column sums of the composite products: ``Hs`` ``(L, ..., n, n)`` -> ``(L, ..., n)``.

    s²HC Fig. 7: after 20 Sinkhorn rounds mHC's single-layer column sums peak at 2.0 and its 28-layer
    composite's at 3.6; exactly doubly stochastic families and s²HC stay at 1.
    """
    return composite_product(Hs).sum(dim=-2)


def stream_similarity(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Pairwise cosine similarity of the ``n`` streams: ``x`` ``(..., n, C)`` -> ``(..., n, n)``, float64.

    Entry ``(i, j)`` is ``⟨x_i, x_j⟩ / (‖x_i‖ ‖x_j‖)`` (the diagonal is 1; a zero stream gives 0). Streams that
    are copies (as after the embedding) give 1 everywhere; values near 1 deep in the network mean the streams
    have collapsed into one.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"x must be a tensor of streams (..., n, C), got {getattr(x, 'shape', type(x).__name__)}")
    x = x.detach().to(torch.promote_types(x.dtype, torch.float64))
    unit = x / x.norm(dim=-1, keepdim=True).clamp_min(eps)
    return unit @ unit.transpose(-1, -2)


# ------------------------------------------------------------------------------------------- stream usage


class Dominant(NamedTuple):
    """The largest share (``share``, float64) and the stream that has it (``stream``, int64; the first on a tie),
    each ``(...)``."""

    share: torch.Tensor
    stream: torch.Tensor


def _streams(w: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(w, torch.Tensor) or w.dim() < 1 or w.shape[-1] < 1:
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"{name} must be a tensor with the streams last, shape (..., n) with n >= 1, got {shape}")
    return w.detach().to(torch.promote_types(w.dtype, torch.float64))


def stream_shares(w: torch.Tensor) -> torch.Tensor:
    """Each stream's share of a per-stream amount: ``w`` ``(..., n)`` -> ``p`` ``(..., n)``, float64,
    ``p_s = |w_s| / Σ_t |w_t|``.

    ``w`` is anything a connection or head puts on each stream for one token: ``H_pre`` (the read weights; HC's
    may be negative, hence ``|.|``: a stream subtracted is used as much as one added), ``H_post`` (the write
    weights), or the norm of what the final read takes from each stream. Each row of ``p`` is non-negative and sums
    to 1, whatever the scale of ``w`` (``c · w`` gives the same shares for any ``c ≠ 0``). A row that puts nothing on
    any stream (``Σ |w| = 0``) or is not finite has no shares: NaN (:func:`mean_shares` leaves it out).
    """
    a = _streams(w, "w").abs()
    total = a.sum(dim=-1, keepdim=True)
    defined = (total > 0) & torch.isfinite(total)
    return torch.where(defined, a / torch.where(defined, total, torch.ones_like(total)), torch.nan)


def mean_shares(shares: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """The mean over tokens of per-token shares (:func:`stream_shares`): ``(..., N, n)`` -> ``(..., n)`` (``dim``:
    the tokens' dimension, default the one before the streams), float64.

    Every token counts the same, whatever the size of its weights. Tokens without shares (NaN rows) are left out;
    with none left every share is NaN. The result sums to 1 over the streams (it is a mean of rows that do).
    """
    shares = _streams(shares, "shares")
    if shares.dim() < 2:
        raise ValueError(f"shares must have tokens and streams, shape (..., N, n), got {tuple(shares.shape)}")
    return torch.nanmean(shares, dim=dim)


def effective_streams(shares: torch.Tensor) -> torch.Tensor:
    """The effective number of streams ``exp(−Σ_s p_s log p_s)`` (``0 log 0 = 0``): ``(..., n)`` -> ``(...)``,
    float64, in ``[1, n]``.

    ``p = shares / Σ shares`` (``shares`` non-negative, e.g. from :func:`stream_shares` or :func:`mean_shares`,
    which already sum to 1). ``n`` when every stream has the same share, 1 when one stream has all of it, and in
    between the number of equal streams that would have the same entropy (the perplexity of the shares). It
    depends on the shares only, not on which stream has which (a permutation of the streams leaves it). A row
    without shares (NaN, or summing to 0) gives NaN.
    """
    p = _streams(shares, "shares")
    if bool((p < 0).any()):
        raise ValueError(f"shares must be non-negative, got a minimum of {p.min().item()}")
    total = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(total > 0, total, torch.nan)
    plogp = torch.where(p > 0, p * torch.log(torch.where(p > 0, p, torch.ones_like(p))), torch.zeros_like(p))
    entropy = -plogp.sum(dim=-1)
    return torch.where(torch.isnan(p).any(dim=-1), torch.nan, torch.exp(entropy))


def dominant_stream(shares: torch.Tensor) -> Dominant:
    """The largest share and its stream: ``(..., n)`` -> :class:`Dominant` ``((...), (...))``. A row without shares
    (NaN) gives share NaN and stream −1."""
    p = _streams(shares, "shares")
    missing = torch.isnan(p).any(dim=-1)
    share, stream = torch.nan_to_num(p, nan=-1.0).max(dim=-1)  # max returns the first index on a tie
    return Dominant(torch.where(missing, torch.nan, share), torch.where(missing, -1, stream))


def stream_norms(x: torch.Tensor) -> torch.Tensor:
    """The L2 norm of each stream: ``x`` ``(..., n, C)`` -> ``(..., n)``, float64. What the output share of a model
    whose final read sums (or averages) its streams is made from (:func:`stream_shares` of these)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"x must be a tensor of streams (..., n, C), got {getattr(x, 'shape', type(x).__name__)}")
    return x.detach().to(torch.promote_types(x.dtype, torch.float64)).norm(dim=-1)
