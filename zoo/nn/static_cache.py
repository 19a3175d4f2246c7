"""A static KV cache: every position's keys and values in tensors allocated once per generation, written in place.

``KVCache`` grows by concatenation: each decoding step allocates and copies every layer's keys and values, and
the layer builds its mask and positions from the cache's length. On a GPU a step is a few small matmuls, so that
bookkeeping, not the arithmetic, is its cost (issue 26: cached decoding slower than recomputing on an H100).
``StaticKVCache`` is the answer of PyTorch's gpt-fast and Hugging Face's ``StaticCache``:

    keys, values    one (b, k, N, e) tensor each per layer, N = capacity (the prompt plus the new tokens), zeros
                    at first; a call writes its l new positions with ``index_copy_``; a compiled step attends to all
                    N slots, those not yet written masked out, an eager call to the written ones (views)
    positions, masks
                    the slots 0..N-1 and the causal band (N, N) (one per sliding window the layers use) are built
                    once; a call's positions and mask are views of them (rows length..length+l-1), narrowed by the
                    key-padding mask when one is given, made once per call and shared by every layer
    cross K/V       an encoder-decoder's cross-attention keys and values, projected from the memory at the first
                    call and reused at every later one

So every decoding step runs the same operations on tensors of the same shapes at the same addresses: what
``torch.compile(mode="reduce-overhead")`` needs to capture the step in one CUDA graph (zoo/tasks/generate.py).
``prepare(l)`` makes the next call's positions and masks ahead of the call, so that a compiled step reads only
tensors and never the Python ``length``, which changes every step (a guard on it would recompile each step).

The keys and values the layers attend to are those of ``KVCache``: in eager mode the same tensors' values and
shapes, so the same sums bit for bit (the tokens of KVCache in every dtype); in a compiled step the unwritten
slots too, with weight exactly 0. The static cache serves the zoo's own attention and position modules
(``refusal`` says why a model cannot use it: a plug-in part keeps ``KVCache``, whose contract it was written
against).
"""
from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from zoo.nn.attention import MultiHeadAttention, window_size
from zoo.nn.cache import KVCache
from zoo.nn.flash_dense import band_allowed
from zoo.nn.positional import (AlibiPositions, LearnedPositions, NoPositions, RotaryPositions,
                               SinusoidalPositions)

__all__ = ["StaticKVCache", "refusal"]

_ZOO_POSITIONS = (NoPositions, SinusoidalPositions, LearnedPositions, RotaryPositions, AlibiPositions)


def _stacks(model: nn.Module) -> list[nn.Module]:
    return [model.decoder] if getattr(model, "kind", None) == "decoder_only" else [model.encoder, model.decoder]


def refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot decode with a StaticKVCache, or None when it can: its decoder's attention must be the
    zoo's MultiHeadAttention with its own forward and mask (a subclass that overrides them, or a plug-in
    attention, gets the KVCache it was written for) and its position modules the zoo's, which take a tensor of
    positions."""
    if getattr(model, "kind", None) not in ("decoder_only", "encoder_decoder"):
        return f"a {getattr(model, 'kind', type(model).__name__)} model does not decode"
    for stack in _stacks(model):
        if type(stack.pos) not in _ZOO_POSITIONS:
            return f"position module {type(stack.pos).__qualname__} is not one of the zoo's"
    for layer in model.decoder.layers:
        for attention in (layer.self_attn, layer.cross_attn):
            if attention is None:
                continue
            if not isinstance(attention, MultiHeadAttention) or \
                    type(attention).forward is not MultiHeadAttention.forward or \
                    type(attention).mask is not MultiHeadAttention.mask:
                return f"attention {type(attention).__qualname__} is not the zoo's MultiHeadAttention"
    return None


class StaticKVCache(KVCache):
    """Keys and values of ``capacity`` positions per sequence, preallocated (see the module docstring). Build one
    with ``StaticKVCache.for_model``; pass it as ``cache=`` to the model like a KVCache, one generation per cache.

    ``length`` counts the positions of the calls made so far, the current one included once it is prepared."""
    keeps_cross = True

    def __init__(self, keys: dict[int, torch.Tensor], values: dict[int, torch.Tensor],
                 bands: dict[int | None, torch.Tensor]):
        super().__init__(keys=keys, values=values, length=0)
        self.batch, _, self.capacity, _ = next(iter(keys.values())).shape
        self.bands = bands
        self.slots = torch.arange(self.capacity, device=next(iter(keys.values())).device)
        self.cross_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._cross_written: set[int] = set()   # layers whose cross K/V are this generation's
        self._static = False
        self.positions: torch.Tensor | None = None   # the prepared call's positions (l,)
        self.allowed: dict[int | None, torch.Tensor] = {}  # its mask over the N slots, by window

    @classmethod
    def for_model(cls, model: nn.Module, batch: int, capacity: int) -> "StaticKVCache":
        """A cache for ``batch`` sequences of up to ``capacity`` positions of ``model``'s decoder, allocated now,
        on the device and in the dtype of its weights."""
        reason = refusal(model)
        if reason is not None:
            raise ValueError(f"StaticKVCache: {reason} (decode with a KVCache)")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= model.max_len:
            raise ValueError(f"StaticKVCache: capacity={capacity} positions: expected 1 to the model's "
                             f"max_len={model.max_len}")
        keys, values, windows = {}, {}, set()
        for layer in model.decoder.layers:
            attention = layer.self_attn
            weight = attention.k_proj.weight
            shape = (batch, attention.kv_heads, capacity, attention.head_dim)
            keys[attention.layer_index] = torch.zeros(shape, device=weight.device, dtype=weight.dtype)
            values[attention.layer_index] = torch.zeros(shape, device=weight.device, dtype=weight.dtype)
            windows.add(attention.window)
        slots = torch.arange(capacity, device=weight.device)
        bands = {w: band_allowed(slots[:, None], slots[None, :], 0, True, window_size(w)) for w in windows}
        return cls(keys, values, bands)

    def mark_static(self) -> None:
        """Tell torch.compile that the buffers keep their addresses: a CUDA graph may then write them in place
        (as Hugging Face's StaticCache does)."""
        self._static = True
        for tensor in (*self.keys.values(), *self.values.values(), *self.bands.values(), self.slots,
                       *(t for kv in self.cross_kv.values() for t in kv)):
            torch._dynamo.mark_static_address(tensor)

    def reset(self) -> None:
        """Empty, for another generation of the same batch and capacity: the same buffers (and addresses)."""
        for tensor in (*self.keys.values(), *self.values.values()):
            tensor.zero_()
        self.length, self.positions, self.allowed = 0, None, {}
        self._cross_written.clear()  # the buffers stay, to be written again at the first call

    def prepare(self, length: int, key_padding_mask: torch.Tensor | None = None) -> None:
        """The positions and masks of the next call, of ``length`` tokens; key_padding_mask (b, positions so far,
        this call's included) True = real, as the model takes it. Called by the model when the caller has not."""
        start, end = self.length, self.length + length
        if end > self.capacity:
            raise ValueError(f"StaticKVCache: positions {start}..{end - 1} beyond its capacity of {self.capacity}")
        self.positions = self.slots[start:end]
        padding = None
        if key_padding_mask is not None:
            if key_padding_mask.shape[-1] != end:
                raise ValueError(f"StaticKVCache: the mask covers {key_padding_mask.shape[-1]} positions; this "
                                 f"call reaches {end}")
            padding = torch.zeros(key_padding_mask.shape[0], self.capacity, dtype=torch.bool,
                                  device=self.slots.device)
            padding[:, :end] = key_padding_mask
            padding = rearrange(padding, "b s -> b 1 1 s")
        self.allowed = {w: band[start:end] if padding is None else band[start:end] & padding
                        for w, band in self.bands.items()}
        self.length = end

    def begin(self, length: int, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.positions is None:
            self.prepare(length, key_padding_mask)
        return self.positions

    def finish(self, length: int) -> None:
        self.positions, self.allowed = None, {}  # a prepared call is used once

    @property
    def offset(self) -> torch.Tensor:
        """The prepared call's positions (l,): its slots."""
        return self.positions

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (b, k, l, e) into this call's slots in place; return the slots attended: all N (b, k, N, e)
        in a compiled step (shapes that never change), the written ones (b, k, length, e), views, in eager mode."""
        keys, values = self.keys[layer], self.values[layer]
        keys.index_copy_(2, self.positions, k)
        values.index_copy_(2, self.positions, v)
        return self._visible(keys, -2), self._visible(values, -2)

    def mask(self, window: int | None) -> torch.Tensor:
        """This call's (l, S), or with padding (b, 1, l, S), bool mask over the slots extend returns (S of them):
        True where query i may attend slot j."""
        return self._visible(self.allowed[window], -1)

    def _visible(self, t: torch.Tensor, slots: int) -> torch.Tensor:
        # Eager: only the written slots, so that the kernel sums exactly what it sums with KVCache, and the tokens
        # are KVCache's in every dtype. Compiled: all N, masked (their weights are 0; the sums' order differs, so
        # in half precision a tie between two logits may break the other way, as with Hugging Face's StaticCache).
        return t if torch.compiler.is_compiling() else t.narrow(slots, 0, self.length)

    def cross(self, layer: int, project) -> tuple[torch.Tensor, torch.Tensor]:
        """The cross-attention keys and values of ``layer``: ``project()`` at the generation's first call (into the
        buffers of an earlier generation of the same shapes, when reset() kept them), then kept."""
        if layer not in self._cross_written:
            new, old = project(), self.cross_kv.get(layer)
            if old is not None and all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(old, new)):
                for a, b in zip(old, new):
                    a.copy_(b)
            else:
                self.cross_kv[layer] = tuple(t.contiguous() for t in new)
                if self._static:
                    for t in self.cross_kv[layer]:
                        torch._dynamo.mark_static_address(t)
            self._cross_written.add(layer)
        return self.cross_kv[layer]
