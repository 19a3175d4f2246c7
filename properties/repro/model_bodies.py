"""The bodies of the model clauses' reproducers (properties/repro/model.py puts each after its header, which has
built the model and defined ``module``, ``forward``, ``decode_step``, ``shifted``, ``built``, ``parts``, ``load``,
``on_device``, ``verdict``, ``DATA``, ``WHAT`` and ``REFERENCE``). Each body is a ``str.format`` template: doubled
braces are the script's own."""
from __future__ import annotations

__all__ = ["BODIES"]

BODIES = {
    "model": '''
outputs = []
with torch.no_grad():
    for args, seed in zip((DATA["first"], DATA["second"]), DATA.get("seeds") or (None, None)):
        if seed is not None:   # the clause seeded torch's generator before each pass
            torch.manual_seed(seed)
        outputs.append(forward(*(on_device(x) for x in args)).double().cpu().reshape(-1))
first, second = outputs[0][DATA["index_first"]], outputs[1][DATA["index_second"]]
if DATA.get("bitwise"):
    bad = ~((second == first) | (second.isnan() & first.isnan()))
    verdict(bad.any(), f"{{WHAT}}: differs from {{REFERENCE}} (bitwise) at {{int(bad.sum())}} of {{bad.numel()}} "
            f"entries (max {{float((second - first).abs().nan_to_num(0).max()):.3e}})")
diff = torch.nan_to_num((second - first).abs(), nan=math.inf)
verdict((diff > DATA["tolerance"]).any(), f"{{WHAT}}: differs by {{float(diff.max()):.3e}} from {{REFERENCE}} at "
        f"{{int((diff > DATA['tolerance']).sum())}} of {{diff.numel()}} entries (tolerance {{DATA['tolerance']:.3e}})")
''',
    "model-decode": '''
# Tolerance: the clause's, relative to the largest |logit| of the full pass at the compared positions.
src, src_mask = on_device(DATA["src"]), on_device(DATA["src_mask"])
tokens, mask, cuts = on_device(DATA["tokens"]), on_device(DATA["mask"]), DATA["cuts"]


def args(tokens, mask):
    return (tokens, mask) if src is None else (src, tokens, src_mask, mask)


with torch.no_grad():
    full = forward(*args(tokens, mask)).double().cpu()
    state, bounds = None, [0, *cuts, tokens.shape[1]]
    for start, end in zip(bounds[:-1], bounds[1:]):
        logits, state = decode_step(*args(tokens[:, start:end], mask[:, :end]), state)
        real = mask[:, start:end].cpu()
        cached, expected = logits.double().cpu()[real], full[:, start:end][real]
        finite = expected[torch.isfinite(expected)]
        tolerance = DATA["relative"] * max(float(finite.abs().max()) if finite.numel() else 0.0, 1e-300)
        diff = torch.nan_to_num((cached - expected).abs(), nan=math.inf)
        if (diff > tolerance).any():
            verdict(True, f"cached decoding of positions {{start}}..{{end - 1}} (chunks {{bounds}}) "
                    f"vs the full forward pass: differs by {{float(diff.max()):.3e}} at "
                    f"{{int((diff > tolerance).sum())}} of {{diff.numel()}} real entries (tolerance {{tolerance:.3e}})")
verdict(False, "")
''',
    "model-batched-decode": '''
# Tolerance: the clause's, relative to the largest |logit| of the tensor compared with.
prompts, prefill, offsets, relative = DATA["prompts"], DATA["prefill"], DATA["offsets"], DATA["relative"]


def args(src, tokens, mask):
    return (tokens, mask) if src is None else (on_device(src[0]), tokens, on_device(src[1]), mask)


def decode(src, tokens, mask, cuts):
    """Logits of each chunk [cuts[i], cuts[i + 1]), the mask covering every position so far."""
    out, state = [], None
    for start, end in zip(cuts, cuts[1:]):
        logits, state = decode_step(*args(src, tokens[:, start:end], mask[:, :end]), state)
        out.append(logits.double().cpu())
    return out


def differs(actual, expected):
    finite = expected[torch.isfinite(expected)]
    tolerance = relative * max(float(finite.abs().max()) if finite.numel() else 0.0, 1e-300)
    diff = torch.nan_to_num((actual - expected).abs(), nan=math.inf)
    return float(diff.max()) if diff.numel() else 0.0, tolerance


with torch.no_grad():
    tokens, mask = on_device(DATA["tokens"]), on_device(DATA["mask"])
    batched = decode(DATA["src"], tokens, mask, [0, *(prefill + o for o in offsets)])
    for row, (p, ids, solo_src) in enumerate(zip(prompts, DATA["samples"], DATA["solo_src"])):
        ids = on_device(ids)
        ones = torch.ones_like(ids, dtype=torch.bool)
        alone = decode(solo_src, ids, ones, [0, *(p + o for o in offsets)])
        full = forward(*args(solo_src, ids, ones))[0].double().cpu()
        for step, (together, single) in enumerate(zip(batched, alone)):
            start = 0 if step == 0 else p + offsets[step - 1]
            mine = together[row, -single.shape[1]:]   # the prefill's real positions are its last p
            for other, name in ((single[0], "the sample decoded alone"),
                                (full[start:start + single.shape[1]], "its forward pass")):
                diff, tolerance = differs(mine, other)
                if not diff <= tolerance:
                    what = "the prefill" if step == 0 else f"chunk {{step}} ({{single.shape[1]}} token(s))"
                    verdict(True, f"sample {{row}} (prompt of {{p}}, {{prefill - p}} pads on the left) at "
                            f"{{what}}: the batched cached logits differ by {{diff:.3e}} from {{name}} (tolerance {{tolerance:.3e}}) "
                            f"[prompts {{tuple(prompts)}} left-padded to {{prefill}}, then chunks {{DATA['chunks']}}]")
verdict(False, "")
''',
    "model-diff": '''
# The reference as the run built it: its factory called with the model under test where it takes one argument (here
# the Subject, or for a zoo model an object with its module, forward and decode_step), torch's generator seeded.
import inspect
import types

factory = load(DATA["reference_factory"])
takes = [p for p in inspect.signature(factory).parameters.values()
         if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
under_test = built if not isinstance(built, torch.nn.Module) else types.SimpleNamespace(
    module=module, forward=forward, decode_step=decode_step)
torch.manual_seed(FACTORY_SEED)
ref_module, ref_forward, ref_decode_step, _ = parts(factory(under_test) if takes else factory())
if DATA["float64"]:
    ref_module.to(torch.float64)
bound, mask = DATA["bound"], DATA["mask"]   # the clause's: each model's own tolerance plus 16 x their noise here


def chunks(step, src, tokens):
    """The logits of each chunk [cuts[i], cuts[i + 1]) decoded with decode_step, the mask covering all so far."""
    state, m = None, on_device(mask)
    for start, end in zip(DATA["cuts"], DATA["cuts"][1:]):
        args = (tokens[:, start:end], m[:, :end]) if src is None else (src[0], tokens[:, start:end], src[1], m[:, :end])
        logits, state = step(*args, state)
        yield logits.double().cpu()


def gradients(module, forward, args):
    """d/d(parameters) of sum(out * weights) over the real positions (MODEL-DIFF-GRADIENT's loss)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n in DATA["names"]]
    with torch.enable_grad():
        out = forward(*args)
        loss = (out * on_device(DATA["weights"])[:, :out.shape[1]].to(out))[on_device(mask)].sum()
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {{n: (torch.zeros_like(p) if g is None else g).double().cpu() for (n, p), g in zip(named, grads)}}


mine, theirs = [on_device(x) for x in DATA["first"]], [on_device(x) for x in DATA["second"]]
if DATA.get("names"):   # MODEL-DIFF-GRADIENT: the parameters both models have, by name and shape
    ga, gr = gradients(module, forward, mine), gradients(ref_module, ref_forward, theirs)
    for name in DATA["names"]:
        diff = (ga[name] - gr[name]).abs()
        over = (diff.nan_to_num(math.inf) > bound).nonzero()
        if len(over):
            first = tuple(int(i) for i in over[0])
            verdict(True, f"{{WHAT}}: the gradient of {{name}} parts from the reference's first at index {{first}}: "
                    f"{{float(ga[name][first]):.6e}} vs {{float(gr[name][first]):.6e}} (difference "
                    f"{{float(diff[first]):.3e}}); bound {{bound:.3e}} (each model's own tolerance plus 16 x their "
                    f"gradient noise measured on this input)")
    verdict(False, "")
with torch.no_grad():
    if DATA["cuts"] is None:   # MODEL-DIFF-FORWARD: one forward pass of each
        pairs = [(forward(*mine).double().cpu(), ref_forward(*theirs).double().cpu())]
    else:                      # MODEL-DIFF-DECODE: cached decoding of each, chunk by chunk
        src_a, src_r = (None, None) if len(mine) == 2 else ((mine[0], mine[2]), (theirs[0], theirs[2]))
        pairs = zip(chunks(decode_step, src_a, mine[-2]), chunks(ref_decode_step, src_r, theirs[-2]))
    for step, (x, y) in enumerate(pairs):
        diff = (x - y).abs().amax(-1)
        if DATA["cuts"] is None:
            diff = diff.masked_fill(~mask, 0)
        over = (diff.nan_to_num(math.inf) > bound).nonzero()
        if len(over):
            first = tuple(int(i) for i in over[0])
            where = (f"(sample, position) {{first}}" if DATA["cuts"] is None else
                     f"step {{step}}, sample {{first[0]}}, position {{DATA['cuts'][step] + first[1]}}")
            verdict(True, f"{{WHAT}} parts from the reference {{DATA['reference_factory']}} first at {{where}} by "
                    f"{{float(diff[first]):.3e}}; bound {{bound:.3e}} (each model's own tolerance plus 16 x their "
                    f"noise measured on this input)")
verdict(False, "")
''',
    "model-causal-gradient": '''
# Exact: a masked score's weight is exactly 0, so every gradient path from a later position to position i is too.
# The gradient with respect to the token embeddings is read by adding a zero tensor to the embedding's output.
i, tokens, weights, real = DATA["position"], on_device(DATA["tokens"]), DATA["weights"], DATA["real"]
embedding = built.decoder.embedding if isinstance(built, torch.nn.Module) else built.embedding
deltas = []


def probe(_module, args, kwargs, output):
    given = next((a for a in (*args, *kwargs.values()) if torch.is_tensor(a)), None)
    if given is not None and given.shape == tokens.shape and torch.equal(given, tokens):
        deltas.append(torch.zeros_like(output, requires_grad=True))
        return output + deltas[-1]
    return None


handle = embedding.register_forward_hook(probe, with_kwargs=True)
with torch.enable_grad():
    logits = forward(*(on_device(x) for x in DATA["args"]))
handle.remove()
if len(deltas) != 1:
    verdict(True, f"the embedding was called {{len(deltas)}} times with the target tokens; expected once")
(grad,) = torch.autograd.grad((logits[:, i] * on_device(weights).to(logits)).sum(), deltas[0])
grad = grad.double().cpu()
leaking = ((grad[:, i + 1:] != 0).any(dim=-1) & real[:, None]).nonzero().tolist()
verdict(bool(leaking) or not torch.isfinite(grad).all(), f"d logits[:, {{i}}] / d embedding[:, j] != 0 (or not "
        f"finite) for later positions (sample, j - {{i + 1}}) = {{leaking}}: position {{i}} sees the future")
''',
    "model-shift": '''
args, offset, mask = [on_device(x) for x in DATA["args"]], DATA["offset"], DATA["mask"]
with torch.no_grad():
    base, moved = forward(*args).double().cpu(), shifted(*args, offset).double().cpu()
if mask is not None:   # the real positions
    base, moved = base[mask], moved[mask]
diff = (moved - base).abs().amax(-1).nan_to_num(math.inf)
worst = float(diff.max()) if diff.numel() else 0.0
verdict(not worst <= DATA["bound"], f"shifting every position by {{offset}} (last position {{DATA['last']}}) changes "
        f"the outputs by {{worst:.3e}} (bound {{DATA['bound']:.3e}} = {{DATA['how']}}) although the positions are "
        f"{{WHAT}}: the outputs depend on where the sequence starts")
''',
    "model-factorisation": '''
# log_softmax is 2-Lipschitz in the max norm: twice the logits' tolerance bounds each term.
src, y, mask = on_device(DATA["src"]), on_device(DATA["tokens"]), on_device(DATA["mask"])
src_mask = on_device(DATA["src_mask"])


def logits(k):
    args = (y[:, :k], mask[:, :k]) if src is None else (src, y[:, :k], src_mask, mask[:, :k])
    return forward(*args).double().cpu()


def log_p(scores, next_tokens):
    return torch.log_softmax(scores, -1).gather(-1, next_tokens[..., None])[..., 0]


with torch.no_grad():
    full = logits(y.shape[1])
    one_pass = log_p(full[:, :-1], y[:, 1:].cpu())
    steps = torch.stack([log_p(logits(k)[:, -1], y[:, k].cpu()) for k in range(1, y.shape[1])], dim=1)
finite = full[torch.isfinite(full)]
tolerance = 2 * DATA["relative"] * max(float(finite.abs().max()) if finite.numel() else 0.0, 1e-300)
diff = (steps - one_pass).abs().nan_to_num(math.inf)
verdict(not float(diff.max()) <= tolerance, f"log p(y_k | y_<k) from prefix y_<k differs from the one-pass value by "
        f"{{float(diff.max()):.3e}} (tolerance {{tolerance:.1e}}); totals {{steps.sum(1).tolist()}} vs "
        f"{{one_pass.sum(1).tolist()}}")
''',
}
