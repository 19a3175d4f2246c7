"""MODEL-LAYER-ATTENTION, -NORM, -FFN, -MOE and -ENDS (SPEC.md, "Models"): each part of a model
computes what its config declares for that part (``Subject.declared``, read by the adapter; properties/core/declared.py),
judged by the module oracles composed as the config composes them (properties/module/layer_oracle.py).

A model can be self-consistent and wrong: Gemma 3's local layers rotating with the global base, a scale of
head_dim^-1/2 where the config says query_pre_attn_scalar, YaRN's attention factor left at 1, an RMSNorm without
Gemma's (1 + w), a shared expert without its gate. Every clause that compares the model with itself passes them; here
each attention layer is watched during a forward pass (its input hidden states and its output, through hooks) and
recomputed from its own weights with the declared parameters, and each norm, feed-forward network and
mixture-of-experts block is called on drawn inputs and compared with its declared formula. What the adapter could
not read is named in the report ("not checked: ...").
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import pytest
import torch
from hypothesis import strategies as st

from properties import clause
from properties.core.hooks import first_output, hooks_in_place
from properties.core.declared import Attention, Declared
from properties.core.rotary import describe
from properties.core.routing import describe_rule
from properties.model.checks import module_input, only, pinned_model_property, real_tokens, requires
from properties.model.precision import precision_of
from properties.model.twin import NOT_CHECKED, add_note, observe
from properties.module.approx import Approx, effective_u
from properties.module.layer_oracle import attention_layer, experts_block, feed_forward, norm_output

SHORT = 8          # positions of the short case; a second case runs past each declared length threshold
NORM_SCALES = (0.0, 2.0 ** -12, 2.0 ** -6, 1.0, 8.0)    # token magnitudes: a zero padded embedding, tiny, unit, large
MOE_TOKENS = 12


def _declared(s) -> Declared:
    requires(s, "declared", "the model declares no per-part settings (hf_subject reads them from a transformers "
                            "config)")
    if s.declared.not_checked:
        add_note(NOT_CHECKED + " | ".join(s.declared.not_checked))
    return s.declared


def _parts_read(s, data, field: str, what: str) -> tuple[list, torch.dtype, int]:
    """The declared parts of one kind (``field`` of Declared) the adapter read, the clause skipped when it read none;
    the dtype their bounds are computed in; and the seed of their inputs, drawn."""
    parts = getattr(_declared(s), field)
    if not parts:
        pytest.skip(f"no {what} the adapter could read (see the report's not-checked list)")
    return parts, _dtype(s), data.draw(st.integers(0, 2**16), label="seed")


def _called(module, shape: tuple, weight: torch.Tensor, seed: int, spread: float = 1.0):
    """(x, y): x Gaussian of ``shape`` from ``seed``, times ``spread``, on the device and in the dtype of ``weight``;
    y = module(x) without gradients (its first output)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * spread
    x = x.to(weight.device, weight.dtype)
    with torch.no_grad():
        return x, first_output(module(x))


def _dtype(s) -> torch.dtype:
    """The precision the bounds are computed in: what the suite measured the subject to compute in (a float64 twin
    with float32 islands: float32), else its parameters' dtype."""
    precision = precision_of(s)
    if precision is not None:
        return precision.compute_dtype
    return next((p.dtype for p in s.module.parameters() if p.is_floating_point()), torch.float32)


def _outside(actual: torch.Tensor, oracle: Approx, rows: torch.Tensor | None = None):
    """(index of the worst entry outside the bound, its difference, its bound, entries outside) or None."""
    diff = (actual.detach().to("cpu", torch.float64) - oracle.value).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    excess = diff - oracle.error
    if rows is not None:
        excess = torch.where(rows.reshape(rows.shape + (1,) * (excess.dim() - rows.dim())), excess,
                             torch.full_like(excess, float("-inf")))
    if not (excess > 0).any():
        return None
    worst = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
    return worst, float(diff[worst]), float(oracle.error[worst]), int((excess > 0).sum())


# ------------------------------------------------------------------------------------------ MODEL-LAYER-ATTENTION
@contextmanager
def _watched(parts):
    """Records each module's input hidden states and output during the forward passes inside: {id: (x, y)}."""
    seen, handles = {}, []
    for part in parts:
        def before(_, args, kwargs, key=id(part.module)):
            seen[key] = [module_input(args, kwargs)[0].detach()]

        def after(_, args, kwargs, output, key=id(part.module)):
            seen[key].append(first_output(output).detach())
        handles += [part.module.register_forward_pre_hook(before, with_kwargs=True),
                    part.module.register_forward_hook(after, with_kwargs=True)]
    with hooks_in_place(handles):
        yield seen


def _declaration(a: Attention) -> str:
    words = [f"scale {a.scale:.4g} ({a.why.get('scale', 'declared')})", f"{a.heads} heads, {a.kv_heads} key/value "
             f"heads of {a.head_dim}", f"window {a.window}" if a.window else "no window",
             f"soft cap {a.softcap:g}" if a.softcap else "no soft cap", f"rotary: {describe(a.rotary)}"]
    norms = [f"{w} {n.kind} norm{' (1 + w)' if n.unit_offset else ''}" for w, n in (("q", a.q_norm), ("k", a.k_norm))
             if n is not None]
    return "; ".join(words + norms)


def _alternatives(a: Attention, declared: Declared):
    """(what differs, the same layer with it) for the hint: settings a model is known to get wrong."""
    if abs(a.scale - a.head_dim ** -0.5) > 1e-12 * a.scale:
        yield f"the scale head_dim^-1/2 = {a.head_dim ** -0.5:.4g} instead of {a.why.get('scale', 'the declared')}", \
            dataclasses.replace(a, scale=a.head_dim ** -0.5)
    others = {describe(o.rotary): o.rotary for o in declared.attention if o.rotary != a.rotary}
    for text, rotary in others.items():
        yield f"another layer's rotary embedding ({text})", dataclasses.replace(a, rotary=rotary)
    if a.rotary is not None:
        if a.rotary.kind != "default" or a.rotary.attention_factor not in (None, 1.0):
            yield "the attention factor 1 (cos and sin unscaled)", \
                dataclasses.replace(a, rotary=dataclasses.replace(a.rotary, attention_factor=1.0))
            yield "no frequency scaling (rope_type default)", \
                dataclasses.replace(a, rotary=dataclasses.replace(a.rotary, kind="default", attention_factor=1.0))
        yield "the other pairing of rotary features", \
            dataclasses.replace(a, rotary=dataclasses.replace(a.rotary, interleaved=not a.rotary.interleaved))
        yield "no rotary embedding", dataclasses.replace(a, rotary=None)
    if a.window:
        yield f"a window of {a.window + 1}", dataclasses.replace(a, window=a.window + 1)
        yield "no window", dataclasses.replace(a, window=None)
    if a.softcap:
        yield "no soft cap", dataclasses.replace(a, softcap=None)
    for side in ("q_norm", "k_norm"):
        norm = getattr(a, side)
        if norm is not None:
            flipped = dataclasses.replace(norm, unit_offset=not norm.unit_offset)
            yield f"{side} with gain {'w' if norm.unit_offset else '1 + w'}", \
                dataclasses.replace(a, **{"q_norm": flipped, "k_norm": dataclasses.replace(
                    a.k_norm, unit_offset=not a.k_norm.unit_offset) if a.k_norm else None})


def _hint(a: Attention, declared: Declared, x: torch.Tensor, y: torch.Tensor, dtype) -> str:
    for text, other in _alternatives(a, declared):
        if _outside(y, attention_layer(other, x, dtype)) is None:
            return f"; hint: it computes exactly the declared attention with {text}"
    return ""


def _lengths(s, declared: Declared) -> list[int]:
    """The short case, and one past each length where a declared scaling changes the frequencies."""
    lengths = [min(SHORT, s.max_len)]
    for threshold in declared.length_thresholds:
        if threshold + 1 <= s.max_len or s.extrapolates:
            lengths.append(threshold + 1)
    return sorted(set(lengths))


def _longest(low, high):
    """the longest"""
    return high


@clause("MODEL-LAYER-ATTENTION")
@pinned_model_property({"length": _longest, "seed": 0, "batch size": 2})
def test_attention_layers_compute_their_declared_attention(mut, data):
    s = only(mut.precise, "decoder_only")
    declared = _declared(s)
    if not declared.attention:
        pytest.skip("no attention layer the adapter could read (see the report's not-checked list)")
    dtype = _dtype(s)
    short = data.draw(st.integers(2, min(SHORT, s.max_len)), label="length")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    size = data.draw(st.integers(1, 2), label="batch size")
    for length in sorted({short, *_lengths(s, declared)[1:]}):
        tokens = real_tokens(torch.Generator().manual_seed(seed), (size, length), s, mut.device)
        with torch.no_grad(), _watched(declared.attention) as seen:
            out = s.forward(tokens, torch.ones_like(tokens, dtype=torch.bool))
        observe(s, out, "forward")
        for a in declared.attention:
            assert len(seen.get(id(a.module), ())) == 2, (f"{a.name} ({type(a.module).__name__}) was not called by "
                                                          f"forward: expected the attention module of its layer")
            x, y = seen[id(a.module)]
            observe(s, y, f"{a.name}'s output")
            found = _outside(y, attention_layer(a, x, dtype))
            if found is None:
                continue
            (b, p, f), diff, bound, count = found
            raise AssertionError(
                f"{a.name} ({type(a.module).__name__}), on {length} positions: its output at (sample {b}, position "
                f"{p}, feature {f}) differs from the attention its config declares by {diff:.3e} (bound {bound:.1e} "
                f"in {str(dtype).removeprefix('torch.')}; {count} of {y.numel()} entries outside it); declared: "
                f"{_declaration(a)}{_hint(a, declared, x, y, dtype)}")


# ----------------------------------------------------------------------------------------------- MODEL-LAYER-NORM
def _norm_input(norm, seed: int, device, dtype) -> torch.Tensor:
    """One token per magnitude of NORM_SCALES (the first exactly 0), plus one off-centre token, (1, T, *width)."""
    weight = getattr(norm.module, "weight")
    width = tuple(weight.shape)
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randn(width, generator=g, dtype=torch.float64) * scale for scale in NORM_SCALES]
    tokens.append(torch.randn(width, generator=g, dtype=torch.float64) + 3.0)
    return torch.stack(tokens)[None].to(device, dtype)


@clause("MODEL-LAYER-NORM")
@pinned_model_property({"seed": 0})
def test_norms_compute_their_declared_formula(mut, data):
    norms, dtype, seed = _parts_read(mut.precise, data, "norms", "norm")
    for norm in norms:
        weight = norm.module.weight
        x = _norm_input(norm, seed, weight.device, weight.dtype).requires_grad_(True)
        with torch.enable_grad():
            y = norm.module(x)
            y = first_output(y)
            r = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(y)
            params = [p for p in norm.module.parameters() if p.requires_grad]
            grads = torch.autograd.grad((y * r).sum(), [x, *params], allow_unused=True)
        formula = (f"{'RMSNorm x/√(mean x² + eps)' if norm.kind == 'rms' else 'LayerNorm (x − mean)/√(var + eps)'} "
                   f"× {'(1 + w)' if norm.unit_offset else 'w'}{' + b' if getattr(norm.module, 'bias', None) is not None else ''}, "
                   f"eps {norm.eps:g}")
        nonfinite = [name for name, g in zip(["its input", *(n for n, p in norm.module.named_parameters()
                                                            if p.requires_grad)], grads)
                     if g is not None and not torch.isfinite(g).all()]
        if nonfinite:
            zero = bool(torch.isnan(grads[0][0, 0]).any() | torch.isinf(grads[0][0, 0]).any())
            raise AssertionError(
                f"{norm.name} ({type(norm.module).__name__}): NaN or infinite gradient with respect to "
                f"{', '.join(nonfinite)}{' at a zero input (token 0, as a zero padded embedding)' if zero else ''}; "
                f"the declared {formula} has finite gradients everywhere; hint: eps outside the square root "
                f"(x/(√(mean x²) + eps)) has an infinite derivative at 0")
        found = _outside(y, norm_output(norm, x.detach(), dtype))
        if found is not None:
            index, diff, bound, count = found
            scale = NORM_SCALES[index[1]] if index[1] < len(NORM_SCALES) else "1 (off-centre by 3)"
            raise AssertionError(
                f"{norm.name} ({type(norm.module).__name__}): its output at token {index[1]} (magnitude {scale}), "
                f"feature {index[2:]} differs from the declared {formula} by {diff:.3e} (bound {bound:.1e}; {count} "
                f"entries outside it){_norm_hint(norm, x.detach(), y, dtype)}")


def _norm_hint(norm, x, y, dtype) -> str:
    for text, other in ((f"gain {'w' if norm.unit_offset else '1 + w'}", dataclasses.replace(
            norm, unit_offset=not norm.unit_offset)), (f"the other kind ({'LayerNorm' if norm.kind == 'rms' else 'RMSNorm'})",
                                                    dataclasses.replace(norm, kind="layer" if norm.kind == "rms" else "rms"))):
        if _outside(y, norm_output(other, x, dtype)) is None:
            return f"; hint: it computes the declared formula with {text}"
    return "; hint: eps outside the square root, or another eps, shows at the tiny tokens"


# ------------------------------------------------------------------------------------------------ MODEL-LAYER-FFN
@clause("MODEL-LAYER-FFN")
@pinned_model_property({"seed": 0})
def test_feed_forward_networks_compute_their_declared_activation(mut, data):
    networks, dtype, seed = _parts_read(mut.precise, data, "feed_forward", "feed-forward network")
    for ffn in networks:
        weight = ffn.weights()["down"][0]
        x, y = _called(ffn.module, (2, 3, weight.shape[0]), weight, seed, spread=2.0)
        found = _outside(y, feed_forward(ffn, x, dtype))
        if found is not None:
            index, diff, bound, count = found
            raise AssertionError(
                f"{ffn.name} ({type(ffn.module).__name__}): its output at {index} differs from the declared "
                f"{'gated ' if ffn.gated else ''}feed-forward network with activation {ffn.activation} by {diff:.3e} "
                f"(bound {bound:.1e}; {count} entries outside it){_ffn_hint(ffn, x, y, dtype)}")


def _ffn_hint(ffn, x, y, dtype) -> str:
    for activation in ("silu", "gelu", "gelu_tanh", "relu"):
        if activation != ffn.activation and _outside(y, feed_forward(dataclasses.replace(ffn, activation=activation),
                                                                     x, dtype)) is None:
            return f"; hint: it computes the same network with activation {activation}"
    return ""


# ------------------------------------------------------------------------------------------------ MODEL-LAYER-MOE
@clause("MODEL-LAYER-MOE")
@pinned_model_property({"seed": 0})
def test_experts_blocks_route_and_combine_as_declared(mut, data):
    blocks, dtype, seed = _parts_read(mut.precise, data, "experts", "mixture-of-experts block")
    for block in blocks:
        router = block.router()[0]
        x, y = _called(block.module, (1, MOE_TOKENS, router.shape[1]), router, seed)
        y = y.reshape(MOE_TOKENS, -1)
        expected, decided = experts_block(block, x.reshape(MOE_TOKENS, -1), dtype)
        assert decided.any(), (f"{block.name}: every one of {MOE_TOKENS} tokens lies within rounding of a tie between "
                               f"two experts; nothing to check")
        found = _outside(y, expected, rows=decided)
        if found is not None:
            (token, feature), diff, bound, count = found
            raise AssertionError(
                f"{block.name} ({type(block.module).__name__}): token {token}'s output, feature {feature}, differs from "
                f"the declared block by {diff:.3e} (bound {bound:.1e}; {count} entries outside it over "
                f"{int(decided.sum())} tokens clear of a tie); declared: routing {describe_rule(block.rule)}, experts "
                f"with activation {block.activation}"
                + (f", a shared expert{' gated by sigmoid(x·W)' if block.shared_gate else ''}" if block.shared else "")
                + _moe_hint(block, x.reshape(MOE_TOKENS, -1), y, decided, dtype))


def _moe_hint(block, x, y, decided, dtype) -> str:
    variants = []
    if block.shared_gate is not None:
        variants.append(("the shared expert added without its sigmoid gate", dataclasses.replace(block,
                                                                                              shared_gate=None)))
    if block.rule.normalized is not None:
        variants.append((f"the chosen weights {'not ' if block.rule.normalized else ''}renormalised",
                         dataclasses.replace(block, rule=dataclasses.replace(block.rule,
                                                                             normalized=not block.rule.normalized))))
    if block.rule.bias is not None:
        variants.append(("the correction bias ignored in the choice",
                         dataclasses.replace(block, rule=dataclasses.replace(block.rule, bias=None))))
    if block.rule.scale != 1.0:
        variants.append(("routed_scaling_factor not applied", dataclasses.replace(
            block, rule=dataclasses.replace(block.rule, scale=1.0))))
    for text, other in variants:
        expected, _ = experts_block(other, x, dtype)
        if _outside(y, expected, rows=decided) is None:
            return f"; hint: it computes the declared block with {text}"
    return ""


# ----------------------------------------------------------------------------------------------- MODEL-LAYER-ENDS
@contextmanager
def _ends_watched(ends):
    """Records the first layer's input hidden states and the head's input and output: {"first", "head in", "head"}."""
    seen, handles = {}, []

    def first(_, args, kwargs):
        seen["first"] = module_input(args, kwargs)[0].detach()

    def head(_, args, output):
        seen["head in"], seen["head"] = args[0].detach(), output.detach()
    handles += [ends.first_layer.register_forward_pre_hook(first, with_kwargs=True),
                ends.head.register_forward_hook(head)]
    with hooks_in_place(handles):
        yield seen


def _scaled(value: torch.Tensor, scale: float, softcap: float | None, u: float) -> Approx:
    """z·scale, then c·tanh(·/c) under a soft cap c: values and a bound of a few roundings (the product, the
    division, tanh within 2 ulp, the product by c: 1-Lipschitz in the argument)."""
    z = value.detach().to("cpu", torch.float64)
    y = z * scale
    error = 2 * u * y.abs()
    if softcap:
        y = softcap * torch.tanh(y / softcap)
        error = error + 6 * u * y.abs() + u * (z * scale).abs()
    return Approx(y, error)


@clause("MODEL-LAYER-ENDS")
@pinned_model_property({"length": _longest, "seed": 0, "batch size": 2})
def test_embeddings_and_logits_are_scaled_as_declared(mut, data):
    s = only(mut.precise, "decoder_only")
    declared = _declared(s)
    ends = declared.ends
    if ends is None:
        pytest.skip("the model's ends were not read (see the report's not-checked list)")
    u = effective_u(_dtype(s))
    length = data.draw(st.integers(2, min(SHORT, s.max_len)), label="length")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    size = data.draw(st.integers(1, 2), label="batch size")
    tokens = real_tokens(torch.Generator().manual_seed(seed), (size, length), s, mut.device)
    with torch.no_grad(), _ends_watched(ends) as seen:
        logits = s.forward(tokens, torch.ones_like(tokens, dtype=torch.bool))
    observe(s, logits, "forward")
    assert "first" in seen and "head" in seen, "the first layer or the head was not called by forward"
    table = ends.embedding.weight.detach()[tokens]
    found = _outside(seen["first"], _scaled(table, ends.embedding_scale, None, u))
    if found is not None:
        index, diff, bound, count = found
        ratio = float((seen["first"].double().norm() / table.double().norm()).cpu())
        raise AssertionError(
            f"the first layer's input at {index} differs from the token embeddings times {ends.embedding_scale:.6g} "
            f"({ends.why.get('embedding')}) by {diff:.3e} (bound {bound:.1e}; {count} entries outside it); its norm "
            f"is {ratio:.6g} times the embeddings'; hint: the embedding scale "
            f"{'left out' if abs(ratio - 1) < 1e-6 else f'{ratio:.6g} instead of {ends.embedding_scale:.6g}'}")
    found = _outside(logits, _scaled(seen["head"], ends.logit_scale, ends.logit_softcap, u))
    if found is not None:
        index, diff, bound, count = found
        plain = _outside(logits, _scaled(seen["head"], 1.0, None, u)) is None
        raise AssertionError(
            f"the logits at {index} differ from the head's output times {ends.logit_scale:.6g}"
            f"{f', capped to {ends.logit_softcap:g}·tanh(z/{ends.logit_softcap:g})' if ends.logit_softcap else ''} "
            f"(final_logit_softcapping, logit_scale, logits_scaling) by {diff:.3e} (bound {bound:.1e}; {count} entries "
            f"outside it)" + ("; hint: they are the head's output unchanged" if plain else ""))
