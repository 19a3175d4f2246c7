"""Rounding-error bounds for attention, derived from the standard model of floating-point arithmetic.

Steps numbered as in SPEC.md, "Tolerance model" (module-level oracles cite them):

1. Model.  The kernel's inputs are exact in the tested dtype; every operation it performs is rounded
   with unit roundoff at most u = eps(dtype) / 2 (a kernel that accumulates in a wider type only does
   better), except that for float16 and bfloat16 the sums over E, S and L (dot products, row sums, weighted
   sums) accumulate in float32, as PyTorch's SDPA backends and FlashAttention do: a bounded number of roundings
   per value to the dtype itself (``rounding_error``), so long rows keep a meaningful bound; ``exp`` is accurate
   to 2 ulps (4u; libm, SLEEF and GPU ``ex2.approx`` all are).  gamma(n) = n u / (1 - n u) bounds n successive
   roundings (Higham, *Accuracy and Stability of Numerical Algorithms*, 3.1).
2. Scores.  A dot product of length E, the scale (rounded, applied once or as sqrt(scale) to both sides)
   and the float mask cost at most E + 5 roundings: |s_hat - s| <= gamma(E + 5) * (scale * sum_e |q_e k_e|
   + |mask|).  Subtracting a running maximum (or multiplying by log2 e) before ``exp`` moves the argument
   by at most 2u * (|s - max s| + the score errors).  Call the sum of both ``score_error`` (delta).
3. Softmax of perturbed scores.  Softmax is increasing in its own score and decreasing in the others, so
   every weight computed from scores within +-delta lies in
       [exp(s_j - d_j) / (exp(s_j - d_j) + sum_{l != j} exp(s_l + d_l)),
        exp(s_j + d_j) / (exp(s_j + d_j) + sum_{l != j} exp(s_l - d_l))]
   (evaluated in log space, so huge scores stay informative: a large gap keeps the interval one-hot).
4. Evaluation.  ``exp`` (4u), the row sum and the rescaling of an online (flash) softmax (2S roundings in
   numerator and denominator together), the division and the rounding to the dtype change a weight by a
   factor within 1 +- gamma(2S + 6).  A weight may also underflow: +- finfo.tiny absolute.
5. Output.  sum_j w_j v_j costs gamma(S + 2) * sum_j w_j |v_j| (S products, S - 1 sums, the final
   rounding to the dtype).
6. Half precision at length.  A kernel keeps its running state (maximum, row sum, accumulator) in float32, as
   FlashAttention and PyTorch's backends do; what it stores in the dtype is counted, not guessed per S: a weight
   at most ``STORED_WEIGHT_ROUNDINGS`` times (P before P.V; a math backend's normalized weight; read through
   V = I, the output it becomes) and the output ``STORED_OUTPUT_ROUNDINGS`` time.  The float32 terms grow as
   gamma_32(2S), below one rounding of the dtype up to S = 2^15, so the bound follows the error of a
   float32-state computation at every length; a kernel that rounds its state once per key tile adds S / 64
   roundings of the dtype and leaves it at S = 1024 (SPEC.md, "Tolerance model", step 6).

7. Merged partial states.  A kernel that computes attention over key blocks as partial states (o_i, lse_i) and
   merges them (flash-decoding, cascade attention, ring attention; zoo/nn/partial.py) rescales each state once per
   merge by exp(lse_i - lse).  With n states merged in the accumulation type (unit roundoff u_a), each LSE stored
   and re-rounded at most n times (|lse| <= M: the largest admissible |score| of the row plus log S), the exponent's
   argument is off by at most 2 n u_a M, exp adds 4u_a, and the products, the sums of n terms and the division
   gamma(2n + 6): every weight gains the relative error ``merge_error(n, dtype, M)`` on top of step 4.  Over one
   block (n = 1) nothing is added; the term grows with n only through these counts.  A left fold of n states by a
   two-state merge (n - 1 merges in sequence, each rescaling its two states: the two LSEs re-rounded and subtracted,
   4 u_a M on the difference of the exponents; two exps, the sum, the product, the sum of products, the division,
   gamma(12)) compounds its merges' errors: ``fold_error``.

The oracle itself runs in float64, so the same model with u = 2^-53 is added on top: for float64 inputs
the oracle is no more exact than the kernel, and both errors count.  The bounds are worst cases: never
exceeded by a correct kernel (no flaky failures), loose by roughly sqrt(n) for typical roundings.
"""
from __future__ import annotations

import math
import torch

from properties.core.oracle import Reference, expand_kv_heads, reference_attention, to_float64

__all__ = ["unit_roundoff", "gamma", "accumulation_roundoff", "rounding_error", "evaluation_error", "rowsum_error", "SoftmaxBounds", "softmax_bounds",
           "output_bound", "quick_output_bound", "deciding_output_bound", "STORED_WEIGHT_ROUNDINGS",
           "STORED_OUTPUT_ROUNDINGS", "merge_error", "fold_error", "lse_magnitude", "lse_bound"]

_F64 = torch.float64


# Step 6: roundings to the dtype itself of a weight on its way to the output, and of the output (float32 and float64
# count them with the accumulation's).
STORED_WEIGHT_ROUNDINGS = 2
STORED_OUTPUT_ROUNDINGS = 1


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2: the largest relative error of rounding to ``dtype``."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error of n successive roundings."""
    return n * u / (1 - n * u) if n * u < 1 else math.inf


def accumulation_roundoff(dtype: torch.dtype) -> float:
    """Step 1: the unit roundoff of the sums over E, S and L, float32's for float16/bfloat16 inputs (as PyTorch's
    math and fused SDPA backends and FlashAttention accumulate them), the dtype's own otherwise."""
    return unit_roundoff(torch.float32) if dtype in (torch.float16, torch.bfloat16) else unit_roundoff(dtype)


def rounding_error(n: int, c: int, dtype: torch.dtype) -> float:
    """n roundings in the accumulation type and c roundings to ``dtype`` itself (values a kernel stores in the
    dtype: q pre-scaled, scores, weights, the output): gamma(n + c) for float32 and float64, gamma(n) of float32
    plus gamma(c) of the dtype for float16 and bfloat16."""
    u, ua = unit_roundoff(dtype), accumulation_roundoff(dtype)
    return gamma(n + c, u) if ua == u else gamma(n, ua) + gamma(c, u)


def evaluation_error(s: int, dtype: torch.dtype) -> float:
    """Steps 4 and 6: relative error of evaluating a softmax over s keys in ``dtype`` (plus the oracle's): exp, the
    row sum and the online rescaling, the division (2s + 4 roundings of the accumulation type) and the weight's
    own storage in the dtype."""
    return rounding_error(2 * s + 4, STORED_WEIGHT_ROUNDINGS, dtype) + gamma(2 * s + 6, unit_roundoff(_F64))


def merge_error(states: int, dtype: torch.dtype, magnitude: float) -> float:
    """Step 7: the relative error that merging ``states`` partial states (out_i, lse_i) in the accumulation type adds
    to every weight, the LSEs bounded by ``magnitude`` in absolute value; 0 for a single state."""
    if states <= 1:
        return 0.0
    ua = accumulation_roundoff(dtype)
    return math.expm1(2 * states * ua * magnitude) + gamma(2 * states + 6, ua)


def fold_error(states: int, dtype: torch.dtype, magnitude: float) -> float:
    """Step 7 for a left fold of ``states`` partial states by a two-state merge (FlashInfer's ``merge_state`` applied
    n - 1 times): each merge adds expm1(4 u_a M) + gamma(12) to the weights of its two states, compounded over the
    n - 1 merges a state of the first block goes through; 0 for a single state."""
    if states <= 1:
        return 0.0
    ua = accumulation_roundoff(dtype)
    return (1 + math.expm1(4 * ua * magnitude) + gamma(12, ua)) ** (states - 1) - 1


def lse_magnitude(scores: torch.Tensor) -> float:
    """A bound on |lse| of every partial state of the rows of ``scores`` (float64, -inf where not admissible): the
    largest admissible |score| plus log S (a block's LSE lies between its largest score and that plus log S)."""
    admissible = scores > float("-inf")
    if not bool(admissible.any()):
        return 0.0
    return float(scores[admissible].abs().max()) + math.log(max(scores.shape[-1], 1))


def rowsum_error(s: int, dtype: torch.dtype) -> float:
    """Bound on |sum_j w_hat_ij - 1|: the normalization divides the exponentials it sums, so score errors
    cancel and only the evaluation error and underflow of s weights remain."""
    return evaluation_error(s, dtype) + s * torch.finfo(dtype).tiny


class SoftmaxBounds:
    """Oracle and error intervals for the weights of one attention call (all float64, CPU).

    The oracle (``reference``) is computed at once; the intervals (``score_error``, ``lower``, ``upper``: steps 2-4,
    O(L·S) with a large constant) when first read, so that a comparison that passes the sufficient bound
    (``quick_output_bound``) never pays for them."""

    def __init__(self, reference: Reference, interval, eval_error: float, rowsum_error: float, dtype: torch.dtype,
                 tiny: float):
        self.reference = reference            # the oracle (scores, weights, output)
        self._interval = interval             # () -> (score_error, lower, upper)
        self._computed = None
        self.eval_error = eval_error          # step 4: relative error of evaluating the softmax (both precisions)
        self.rowsum_error = rowsum_error      # bound on |sum_j w_hat_ij - 1| for a row with an admissible key
        self.dtype = dtype
        self.tiny = tiny                      # underflow slack per weight

    def _intervals(self):
        if self._computed is None:
            self._computed = self._interval()
        return self._computed

    @property
    def score_error(self) -> torch.Tensor:
        """(..., l, s) delta of step 2, tested dtype plus the oracle's float64."""
        return self._intervals()[0]

    @property
    def lower(self) -> torch.Tensor:
        """(..., l, s): every correctly computed weight is >= lower ..."""
        return self._intervals()[1]

    @property
    def upper(self) -> torch.Tensor:
        """... and <= upper; both are exactly 0 where a key is not admissible."""
        return self._intervals()[2]

    @property
    def weights(self) -> torch.Tensor:
        return self.reference.weights

    @property
    def admissible(self) -> torch.Tensor:
        return self.reference.scores > float("-inf")

    def log_weight_error(self) -> tuple[torch.Tensor, float]:
        """(e, slack): |log(w_hat_j / w_hat_k) - (s_j - s_k)| <= e_j + e_k + slack for any two keys of a row
        (denominators cancel): e (..., l, s) is the score error plus underflow, slack the evaluation's."""
        slack = 2 * math.atanh(min(self.eval_error, 1.0)) if self.eval_error < 1 else math.inf
        # Underflow: a weight w >= lower carries absolute error <= tiny, i.e. log error <= log1p(tiny/lower).
        under = torch.log1p(self.tiny / self.lower.clamp_min(1e-300))
        return self.score_error + under, slack

    def log_ratio_error(self) -> torch.Tensor:
        """(..., l, s, s): bound on |log(w_hat_j / w_hat_k) - (s_j - s_k)| for every pair (small problems only)."""
        e, slack = self.log_weight_error()
        return e[..., :, None] + e[..., None, :] + slack


def _log_sum_exp_of_others(x: torch.Tensor):
    """(log sum_{l != j} exp(x_l) for every j, the same before adding back the maximum, the exponents x - max):
    -inf where no other term. From exclusive prefix and suffix sums of exp(x - max), so that the own term is never
    subtracted (no cancellation when it dominates) and memory stays (..., s)."""
    top = x.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    exponent = x - top
    log_others = torch.log(_sum_of_others(torch.exp(exponent)))
    return log_others + top, log_others, exponent


def _sum_of_others(terms: torch.Tensor) -> torch.Tensor:
    """sum_{l != j} terms_l for every j, as an exclusive prefix plus an exclusive suffix sum."""
    zero = torch.zeros_like(terms[..., :1])
    before = torch.cat([zero, terms[..., :-1].cumsum(-1)], dim=-1)
    after = torch.cat([terms[..., 1:].flip(-1).cumsum(-1).flip(-1), zero], dim=-1)
    return before + after


def _softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)) without overflow or the threshold approximation of F.softplus."""
    return torch.where(x > 0, x + torch.log1p(torch.exp(-x.abs())), torch.log1p(torch.exp(-x.abs())))


def _score_magnitude(q, k, attn_mask, scale, enable_gqa):
    """scale * sum_e |q_e k_e| + |float mask|: what the rounding error of a score is proportional to."""
    if enable_gqa and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        k = expand_kv_heads(k, q.shape[-3])
    magnitude = abs(scale) * (q.abs() @ k.abs().transpose(-1, -2))
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        finite = to_float64(attn_mask).abs()
        magnitude = magnitude + torch.where(torch.isfinite(finite), finite, torch.zeros_like(finite))
    return magnitude


def softmax_bounds(query, key, value=None, *, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
                   causal_alignment="top-left", dtype=None, merged_states: int = 1,
                   folded: bool = False) -> SoftmaxBounds:
    """The oracle plus the interval every correctly rounded weight lies in (see module docstring).

    ``dtype`` is the precision the kernel is held to (default: the query's).  ``value`` defaults to the
    identity, whose output is the weight matrix.  ``merged_states``: the partial states a kernel may merge per query
    (step 7; 1: none), all at once (``merge_error``) or, ``folded``, two at a time in sequence (``fold_error``).
    Memory and time are O(L S) per slice (no (L, S, S) tensor).
    """
    dtype = dtype or query.dtype
    q, k = to_float64(query), to_float64(key)
    e, s = q.shape[-1], k.shape[-2]
    scale = 1.0 / math.sqrt(e) if scale is None else scale
    reference = reference_attention(q, k, value, attn_mask, is_causal, scale, enable_gqa, causal_alignment)
    step7 = fold_error if folded else merge_error
    merging = step7(merged_states, dtype, lse_magnitude(reference.scores)) if merged_states > 1 else 0.0
    eval_error = evaluation_error(s, dtype) + merging
    tiny = torch.finfo(dtype).tiny

    def interval():
        return _interval(reference, q, k, attn_mask, scale, enable_gqa, dtype, eval_error, tiny)
    return SoftmaxBounds(reference, interval, eval_error, rowsum_error(s, dtype) + merging, dtype, tiny)


def _interval(reference: Reference, q, k, attn_mask, scale, enable_gqa, dtype, eval_error, tiny):
    """(score_error, lower, upper) of steps 2-4 (see ``softmax_bounds``)."""
    e, s = q.shape[-1], k.shape[-2]
    scores, admissible = reference.scores, reference.scores > float("-inf")
    u, u64 = unit_roundoff(dtype), unit_roundoff(_F64)

    # Scores may approach the dtype's largest value (ATTN-LARGE-SCORES, MASK-LOW-PRECISION): every sum
    # below is formed so that it cannot overflow where the quantity it bounds is finite (halved gaps);
    # an infinite exponent means a weight below exp(-finfo(float64).max), i.e. exactly 0.
    dot_error = (rounding_error(e + 1, 4, dtype) + gamma(e + 5, u64)) * _score_magnitude(q, k, attn_mask, scale,
                                                                                          enable_gqa)
    dot_error = torch.where(admissible, dot_error, torch.zeros_like(dot_error))
    finite_scores = torch.where(admissible, scores, torch.zeros_like(scores))
    row_max = torch.where(admissible, scores, torch.full_like(scores, -math.inf)).amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    half_gap = (finite_scores / 2 - row_max / 2).abs()
    argument_error = 4 * (u + u64) * (half_gap + dot_error / 2 + dot_error.amax(-1, keepdim=True) / 2)
    delta = torch.where(admissible, dot_error + argument_error, torch.zeros_like(dot_error))

    # log w_j = -softplus(log sum_{l != j} exp(s_l -+ d_l) - (s_j +- d_j)) (step 3). The sums over the other keys
    # come from exclusive prefix and suffix sums (no (l, s, s) tensor, no subtraction of the own term), and every
    # exponent is taken from the row maximum M, (s - M) -+ d, so that huge scores keep their differences.
    minus_inf = torch.full_like(scores, -math.inf)
    shifted = torch.where(admissible, finite_scores - row_max, torch.zeros_like(scores))
    low = torch.where(admissible, shifted - delta, minus_inf)     # the others' exponents for an upper bound
    high = torch.where(admissible, shifted + delta, minus_inf)    # ... and for a lower bound
    lse_low, log_others_low, exponent_low = _log_sum_exp_of_others(low)
    lse_high, log_others_high, exponent_high = _log_sum_exp_of_others(high)
    # NaN (inf - inf, an overflowed exponent) is replaced on the safe side: -inf raises the upper bound to 1, +inf
    # lowers the lower bound to 0.
    lse_upper = torch.nan_to_num(lse_low - (shifted + delta), nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    lse_lower = torch.nan_to_num(lse_high - (shifted - delta), nan=math.inf, posinf=math.inf, neginf=-math.inf)
    log_upper, log_lower = -_softplus(lse_upper), -_softplus(lse_lower)
    # The interval is itself evaluated in float64.  d log w_j / d(exponent of l) = -w_l, so rounding the exponent
    # of key l (s_l - M, -+ d_l, - the sum's maximum: 3 operations, exp 2 more) moves log w_j by at most
    # u64 (|s_l - M| + |x_l| + |x_l - top| + 2) w_l; the prefix and suffix sums (gamma(s + 3)), j's own exponent,
    # the logarithms and the subtraction move the softplus' argument, which moves log w_j by (1 - w_j) times as
    # much; the softplus adds 4 u64 (1 + |log w_j|) (factor 2 on the whole: first order).
    size = lambda t: torch.where(torch.isfinite(t), u64 * t.abs(), torch.zeros_like(t))  # noqa: E731  (no overflow)
    times = lambda w, t: torch.where(w > 0, w * t, torch.zeros_like(t))                # noqa: E731  (0 * inf = 0)
    weight_cap = torch.where(admissible, log_upper.exp().clamp_max(1.0), torch.zeros_like(scores))
    term_error = 2 * size(shifted) + size(low) + size(high) + size(exponent_low) + size(exponent_high) + 2 * u64
    others_weight = torch.sigmoid(torch.maximum(lse_upper, lse_lower))       # 1 - w_j, at its largest
    through_softplus = gamma(s + 3, u64) + (2 * size(shifted) + 2 * size(delta) + size(log_others_low)
                                            + size(log_others_high) + size(lse_low) + size(lse_high)
                                            + size(lse_upper) + size(lse_lower))
    evaluation = 2 * (_sum_of_others(times(weight_cap, term_error)) + times(others_weight, through_softplus)
                      + 4 * u64 + 4 * size(log_lower))
    # A weight whose upper bound is exp(-inf) is exactly 0 whatever the evaluation error.
    log_upper = torch.where(log_upper == -math.inf, log_upper, log_upper + evaluation)
    log_lower = log_lower - evaluation
    zero = torch.zeros_like(scores)
    upper = torch.where(admissible, (log_upper.exp() * (1 + eval_error)).clamp_max(1 + eval_error) + tiny, zero)
    lower = torch.where(admissible, (log_lower.exp() * (1 - eval_error) - tiny).clamp_min(0.0), zero)
    return delta, lower, upper


def output_bound(bounds: SoftmaxBounds, value, *, extra_roundings: int = 0,
                 weight_factor: float = 1.0, stored_outputs: int = STORED_OUTPUT_ROUNDINGS) -> torch.Tensor:
    """Elementwise bound on |kernel output - oracle output| (step 5 of the module docstring).

    ``weight_factor`` scales every weight (dropout's 1/(1-p)); ``extra_roundings`` counts further
    roundings per weight (dropout's rescale); ``stored_outputs`` the roundings of the output to the dtype itself (a
    fold of merges returns each intermediate output in the dtype).  ``value`` None is the identity V = I (the output
    is the weights): the same bound without the (L, S) x (S, S) products.
    """
    w = bounds.weights
    s = w.shape[-1]
    u64 = unit_roundoff(_F64)
    deviation = torch.maximum(bounds.upper - w, w - bounds.lower)
    has_key = bounds.admissible.any(dim=-1, keepdim=True)
    if value is None:
        bound = weight_factor * (deviation + rounding_error(s + extra_roundings + 1, stored_outputs, bounds.dtype) * bounds.upper
                                 + gamma(s + 1, u64) * w)
        return bound + torch.where(has_key, bounds.tiny, 0.0)
    v = to_float64(value).abs()
    if v.dim() >= 3 and w.dim() >= 3 and v.shape[-3] != w.shape[-3]:
        v = expand_kv_heads(v, w.shape[-3])
    bound = weight_factor * (deviation @ v
                             + rounding_error(s + extra_roundings + 1, stored_outputs, bounds.dtype) * (bounds.upper @ v)
                             + gamma(s + 1, u64) * (w @ v))
    return bound + torch.where(has_key, bounds.tiny, 0.0)


def quick_output_bound(bounds: SoftmaxBounds, value, *, extra_roundings: int = 0,
                       weight_factor: float = 1.0, stored_outputs: int = STORED_OUTPUT_ROUNDINGS) -> torch.Tensor:
    """A bound never above ``output_bound``, from the oracle alone (no intervals): 0.9·(r + γ64(S + 1) + e − 2γ64(S + 3))
    ·Σ_j w_j |v_j|, with r the output's rounding of step 5 and e the evaluation error of step 4. ``output_bound``
    holds r·Σ upper·|v| + γ64(S + 1)·Σ w|v| + Σ |upper − w|·|v|, and the interval contains the exact weight inflated
    by e (upper ≥ w·(1 + e)), which the float64 weight w misses by at most γ64(S + 3); the factor 0.9 covers the
    float64 rounding of the products. So an error within this bound is within that one: a sufficient condition that
    costs one product instead of the intervals' O(L·S) passes, and decides most comparisons of a correct kernel."""
    w = bounds.weights
    s = w.shape[-1]
    u64 = unit_roundoff(_F64)
    factor = 0.9 * weight_factor * max(0.0, rounding_error(s + extra_roundings + 1, stored_outputs, bounds.dtype)
                                       + gamma(s + 1, u64) + bounds.eval_error - 2 * gamma(s + 3, u64))
    if value is None:
        return factor * w
    v = to_float64(value).abs()
    if v.dim() >= 3 and w.dim() >= 3 and v.shape[-3] != w.shape[-3]:
        v = expand_kv_heads(v, w.shape[-3])
    return factor * (w @ v)


def deciding_output_bound(actual: torch.Tensor, expected: torch.Tensor, bounds: SoftmaxBounds, value=None, *,
                          factor: float = 1.0, terms=None, **kwargs) -> torch.Tensor:
    """The bound that decides |actual − expected| as ``factor`` times ``output_bound(bounds, value)`` does (or the
    sum over ``terms``, (value, coefficient) pairs): the quick bounds where the difference is within them everywhere,
    else the full ones, computed only then."""
    terms = [(value, 1.0)] if terms is None else terms
    quick = factor * sum(c * quick_output_bound(bounds, v, **kwargs) for v, c in terms)
    difference = (to_float64(actual) - to_float64(expected)).abs()
    if bool((difference <= quick).all()):
        return quick
    return factor * sum(c * output_bound(bounds, v, **kwargs) for v, c in terms)


def lse_bound(bounds: SoftmaxBounds, lse_dtype: torch.dtype) -> torch.Tensor:
    """(..., l) bound on |a kernel's LSE - the float64 log-sum-exp of the admissible scores|, 0 for a query with no
    admissible key (its LSE is exactly -inf). log-sum-exp is 1-Lipschitz in the max norm of the scores, so the score
    errors (step 2) move it by at most their largest; the row sum's evaluation (step 4, with any merges of step 7)
    moves it by at most -log(1 - eval_error); underflow of S terms against a largest term of 1 by S tiny; the LSE is
    then stored in ``lse_dtype`` (a rounding relative to |lse|)."""
    scores = bounds.reference.scores
    admissible = bounds.admissible
    exact = torch.logsumexp(scores, dim=-1)
    has_key = admissible.any(-1)
    delta = torch.where(admissible, bounds.score_error, torch.zeros_like(bounds.score_error)).amax(-1)
    s = scores.shape[-1]
    evaluation = -math.log1p(-min(bounds.eval_error, 0.5)) if bounds.eval_error < 0.5 else math.inf
    stored = unit_roundoff(lse_dtype) if lse_dtype.is_floating_point else 0.0
    u64 = unit_roundoff(_F64)
    finite = torch.where(has_key, exact, torch.zeros_like(exact)).abs()
    bound = (delta + evaluation + s * bounds.tiny + (stored + gamma(s + 4, u64)) * finite) * (1 + 2 * stored)
    return torch.where(has_key, bound, torch.zeros_like(bound))
