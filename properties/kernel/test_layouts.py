"""ATTN-LAYOUT (SPEC.md, "Integrity, history and layouts"): the output does not depend on the strides of the
inputs. Three layouts real callers hand over: key and value expanded over heads and batch (stride 0: one KV head
shared, a mask (L, S) expanded to (B, H, L, S)), the (B, L, H, E) storage of a projection seen through a transpose,
and slices of larger buffers whose other entries are NaN (a kernel that reads outside the view returns NaN)."""
from __future__ import annotations

import torch
from hypothesis import example

from properties import clause
from properties.core.assertions import assert_within
from properties.core.oracle import to_float64
from properties.core.strategies import on, require_dtype
from properties.core.dtypes import selected_dtypes
from properties.core.tolerance import deciding_output_bound
from properties.kernel.guard import check_against_oracle
from properties.kernel.integrity import assert_unchanged, snapshot
from properties.kernel.problem_space import MASK_EXTRAS, SHAPES, Problem, Space
from properties.kernel.schedule import scheduled

F32 = selected_dtypes()[0]


def _values(case: Problem, layout: str):
    """q, k, v in float64 (B, H, ·, ·); for ``expanded``, k and v equal across heads and batch entries."""
    q, k, v = case.qkv64()
    if layout == "expanded":
        k, v = (t[:1, :1].expand_as(t).contiguous() for t in (k, v))
    return q, k, v


def _laid_out(t: torch.Tensor, layout: str, dtype) -> torch.Tensor:
    """``t`` (B, H, N, D), contiguous, in ``layout``: expanded from its first head and batch entry (stride 0), its
    values in (B, N, H, D) storage seen through a transpose, or a slice (every other row, features 1 … D) of a
    NaN-filled buffer."""
    if layout == "expanded":
        return t[:1, :1].expand_as(t)
    if layout == "transposed":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    b, h, n, d = t.shape
    buffer = torch.full((b, h, 2 * n + 1, d + 2), float("nan"), dtype=dtype, device=t.device)
    view = buffer[:, :, 1::2, 1:d + 1]
    view.copy_(t)
    return view


def _pin(s: int, layout: str, attend: str = "none"):
    return example(case=Problem(lead=(2, 3), l=3, s=s, e=8, ev=8, dtype=F32, seed=0, layout=layout, attend=attend,
                                extras=(("density", 0.5),)))


@clause("ATTN-LAYOUT")
@_pin(33, "expanded")                # S ≡ 1 (mod 32): pytorch/pytorch#191937's class
@_pin(65, "transposed", "causal")    # S ≡ 1 (mod 64)
@_pin(9, "sliced", "float")          # S ≡ 1 (mod 8)
@_pin(17, "expanded", "bool")        # a mask expanded too
@scheduled(Space.of("ATTN-LAYOUT", **{**SHAPES, "rank": ("2",)}, attend=("none", "causal", "bool", "float"),
                    layout=("transposed", "expanded", "sliced"), extras=MASK_EXTRAS))
def test_strides_do_not_change_the_output(kernel, device, causal_alignment, fully_masked, case):
    """Every pair of a layout with the lengths (tail tiles of one key among them), head sizes, dtypes and masks."""
    require_dtype(device, case.dtype)
    layout = case.layout
    kw = case.contract(device)
    if "attn_mask" in kw:   # equal across heads and batch entries, so that it can be expanded
        kw["attn_mask"] = kw["attn_mask"][:1, :1].expand_as(kw["attn_mask"]).contiguous()
    plain = [on(t, case.dtype, device) for t in _values(case, layout)]
    contiguous, bounds = check_against_oracle(kernel, *plain, causal_alignment=causal_alignment,
                                              fully_masked=fully_masked, what="out (contiguous inputs)", **kw)
    q = plain[0] if layout == "expanded" else _laid_out(plain[0], layout, case.dtype)
    k, v = (_laid_out(t, layout, case.dtype) for t in plain[1:])
    if "attn_mask" in kw and layout == "expanded":
        kw["attn_mask"] = _laid_out(kw["attn_mask"], layout, kw["attn_mask"].dtype)
    before = snapshot({"query": q, "key": k, "value": v, "attn_mask": kw.get("attn_mask")})
    strided, _ = check_against_oracle(kernel, q, k, v, causal_alignment=causal_alignment, fully_masked=fully_masked,
                                      what=f"out ({layout} inputs: strides q {q.stride()}, k {k.stride()})", **kw)
    assert_unchanged(before, f"by the kernel ({layout} inputs; the buffers around a slice are the caller's)")
    assert_within(to_float64(strided), to_float64(contiguous),
                  deciding_output_bound(strided, contiguous, bounds, plain[2], factor=2),
                  what=f"out ({layout} inputs)", reference="out (contiguous inputs)")
