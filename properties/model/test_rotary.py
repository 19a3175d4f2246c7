"""MODEL-ROTARY-ANGLES (SPEC.md, "Models"): the rotary tables inside a model hold cos(p·θ) and sin(p·θ) at every
position it accepts, as a float32 computation of them rounds to the model's dtype.

A rotary angle computed in bfloat16 (transformers #29285) rounds the position itself: past 256 to even numbers,
past 512 to multiples of 4, so the angle is off by radians. Whether the model's outputs show it depends on its
weights: at the small random weights of an untrained model (std 0.02) positions move the logits less than bfloat16
rounds them, and MODEL-SHIFT cannot see the bug. The table can: this clause reads it directly, at every position
up to max_len, whatever the weights.

The tables found are Hugging Face's form (Llama, Mistral, Qwen, Gemma, GPT-NeoX and most decoders since 2024): a
module with a tensor ``inv_freq`` of the frequencies θ and ``forward(x, position_ids) -> (cos, sin)`` in x's dtype.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from properties import clause
from properties.core.tolerance import unit_roundoff
from properties.core.watchdog import UserExit, user_call
from properties.model.checks import requires

# Positions checked: every one below max_len up to DENSE, then DENSE more evenly spaced up to max_len - 1 (a table
# of 16k positions and 128 columns is 16 MiB in float64; a rounded angle is wrong at most positions past 256).
DENSE = 8192
# The float32 computation's roundings: the product p·θ (one rounding, |p·θ| u32 absolute in the angle), cos or sin
# (libm and CUDA within 2 ulp = 4 u32 of a result of magnitude at most 1) and the product by attention_scaling
# (u32): ROUNDINGS u32 besides the angle's; then the cast to the output dtype (u_out). Bounded with a factor of 2.
ROUNDINGS = 5
SLACK = 2


def rotary_tables(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every rotary table in Hugging Face's form inside ``module``."""
    found = []
    for name, m in module.named_modules():
        frequencies = getattr(m, "inv_freq", None)
        if not (isinstance(frequencies, torch.Tensor) and frequencies.dim() == 1 and frequencies.is_floating_point()):
            continue
        try:
            parameters = inspect.signature(m.forward).parameters
        except (TypeError, ValueError):
            continue
        if "position_ids" in parameters:
            found.append((name or type(m).__name__, m))
    return found


def _expected(positions: torch.Tensor, frequencies: torch.Tensor, columns: int) -> dict[str, torch.Tensor]:
    """cos and sin of p·θ in float64 for the two column layouts in use: θ repeated as two halves (Llama's
    ``cat((freqs, freqs))``) or interleaved (GPT-J's ``repeat_interleave``); {layout: angles (P, columns)}."""
    angles = positions.double()[:, None] * frequencies.double()[None, :]
    layouts = {"halves": torch.cat((angles, angles), -1), "interleaved": angles.repeat_interleave(2, -1)}
    return {name: a for name, a in layouts.items() if a.shape[-1] == columns}


@clause("MODEL-ROTARY-ANGLES")
def test_rotary_tables_hold_the_angles_at_every_position(mut):
    s = mut.native
    requires(s, "module", "the suite cannot look inside the model")
    tables = rotary_tables(s.module)
    if not tables:
        pytest.skip("no rotary table in Hugging Face's form (a tensor inv_freq, forward(x, position_ids) -> (cos, sin))")
    dtype = next((p.dtype for p in s.module.parameters() if p.is_floating_point()), torch.float32)
    last = s.max_len - 1
    positions = torch.cat([torch.arange(min(s.max_len, DENSE)),
                           torch.linspace(min(last, DENSE), last, DENSE).round().long()]).unique()
    for name, table in tables:
        x = torch.zeros(1, 1, 1, dtype=dtype, device=mut.device)
        ids = positions[None].to(mut.device)
        try:
            with torch.no_grad(), user_call(f"model {name} ({type(table).__name__})", f"its rotary table at "
                                                                                      f"positions 0-{last}"):
                cos, sin = table(x, ids)
        except UserExit:   # sys.exit and the like: a failure of the clause, as everywhere
            raise
        except Exception as exc:  # noqa: BLE001  another form (multimodal position ids, say): not ours to judge
            pytest.skip(f"{name} ({type(table).__name__}) takes inv_freq and position_ids but not in Hugging Face's "
                        f"text form: forward(x, position_ids of shape (1, P)) raised {type(exc).__name__}: {exc}")
        if not all(torch.is_tensor(t) and t.dim() >= 2 and t.shape[-2] == len(positions) and
                   t.numel() == len(positions) * t.shape[-1] for t in (cos, sin)):
            pytest.skip(f"{name} ({type(table).__name__}) returned cos, sin of shapes "
                        f"{tuple(getattr(cos, 'shape', ()))}, {tuple(getattr(sin, 'shape', ()))} for (1, "
                        f"{len(positions)}) position ids: not Hugging Face's text form")
        # read after the call: dynamic scalings (NTK, YaRN, LongRoPE) choose θ from the length they were called with
        frequencies = table.inv_freq.detach().to("cpu", torch.float64)
        scaling = float(getattr(table, "attention_scaling", 1.0) or 1.0)
        observed = {"cos": cos.detach().to("cpu", torch.float64).reshape(len(positions), -1),
                    "sin": sin.detach().to("cpu", torch.float64).reshape(len(positions), -1)}
        layouts = _expected(positions, frequencies, observed["cos"].shape[-1])
        if not layouts:
            pytest.skip(f"{name}: {observed['cos'].shape[-1]} columns for {len(frequencies)} frequencies: a layout "
                        f"the suite does not know")
        u32, u_out = unit_roundoff(torch.float32), unit_roundoff(cos.dtype)

        def error_and_bound(angles):   # cos and sin side by side: two (P, 2 * columns) tensors
            bound = SLACK * abs(scaling) * (angles.abs() * u32 + ROUNDINGS * u32 + u_out)
            error = torch.cat([(observed[f] - scaling * getattr(torch, f)(angles)).abs() for f in ("cos", "sin")], -1)
            return error, torch.cat([bound, bound], -1)

        layout = min(layouts, key=lambda k: float(torch.sub(*error_and_bound(layouts[k])).max()))
        error, bound = error_and_bound(layouts[layout])
        if bool((error <= bound).all()):
            continue
        angles, width = layouts[layout], layouts[layout].shape[-1]
        row, column = divmod(int((error - bound).argmax()), 2 * width)
        first = int(positions[(error > bound).any(-1).nonzero()[0, 0]])
        raise AssertionError(
            f"{name} ({type(table).__name__}): {('cos', 'sin')[column // width]} at position {int(positions[row])}, "
            f"column {column % width} is off by {float(error[row, column]):.3e} (bound {float(bound[row, column]):.1e}, "
            f"what a float32 angle p·θ = {float(angles[row, column % width]):.6g} and a cast to "
            f"{str(cos.dtype).removeprefix('torch.')} may cost; layout '{layout}', the closer of the two); the first "
            f"position off is {first}: the angles are not computed at full precision (positions or frequencies "
            f"rounded to the model's dtype?)")
