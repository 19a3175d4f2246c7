"""What a transformers model's forward actually reaches, read from the autograd graph of one short forward pass.

hf_subject checks two of its guesses against the model itself rather than the config alone:

- parameters forward never uses (Longformer's global query/key/value projections without a global attention mask,
  BigBird's pooler under a masked-LM head): MODEL-GRADIENT would report them as dead;
- positions of two kinds (MPNet: a learned absolute table added to the input *and* T5-style relative buckets): a
  config field naming relative buckets does not make the positions relative when an absolute table is reached too.

No backward pass runs and no ``.grad`` is written: the leaves of the graph (``AccumulateGrad`` nodes) are the
parameters forward reached.
"""
from __future__ import annotations

import torch

__all__ = ["reached_parameters", "absolute_position_tables"]


def _leaves(output: torch.Tensor) -> set[int]:
    """ids of the tensors whose AccumulateGrad nodes lie on the graph of `output`."""
    seen, leaves, stack = set(), set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(child for child, _ in node.next_functions)
    return leaves


def reached_parameters(model: torch.nn.Module, call, length: int) -> set[str]:
    """Names of the trainable parameters that forward reaches on a batch of 2 sequences of `length` real tokens
    (token ids 3.. from a fixed seed, so none is a special token); ``call(tokens, mask)`` returns the output."""
    vocab = model.get_input_embeddings().num_embeddings
    tokens = torch.randint(3, max(4, vocab), (2, length), generator=torch.Generator().manual_seed(0))
    parameter = next(model.parameters())
    tokens = tokens.to(parameter.device)
    with torch.enable_grad():
        leaves = _leaves(call(tokens, torch.ones_like(tokens, dtype=torch.bool)))
    return {name for name, p in model.named_parameters() if p.requires_grad and id(p) in leaves}


def absolute_position_tables(model: torch.nn.Module) -> list[str]:
    """Parameter names of the learned position tables that would be added to the input: an nn.Embedding whose
    module name speaks of positions (``position_embeddings``, ``embed_positions``, GPT-2's ``wpe``) and not of
    relative ones (DeBERTa's ``rel_embeddings``, T5's and MPNet's ``relative_attention_bias``)."""
    found = []
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1].lower()
        if isinstance(module, torch.nn.Embedding) and ("pos" in last or last == "wpe") and "rel" not in last:
            found.append(f"{name}.weight")
    return found
