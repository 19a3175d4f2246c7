"""The three model families, assembled from parts that arrive as factories (Hydra partials).

    EncoderOnly     tokens (b, l)            -> hidden (b, l, d), or head logits (b, l, c)   BERT
    DecoderOnly     tokens (b, l)            -> logits (b, l, vocab)                          GPT-2
    EncoderDecoder  src (b, s), tgt (b, l)   -> logits (b, l, vocab)                          Vaswani et al.

Masks are (b, length) bool, True for a real token and False for padding; None means all real.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from zoo.nn.cache import KVCache
from zoo.nn.packing import Packing
from zoo.nn.embedding import TokenEmbedding, embedding_table
from zoo.nn.blocks import DecoderLayer, EncoderLayer

__all__ = ["EncoderOnly", "DecoderOnly", "EncoderDecoder"]


class _Stack(nn.Module):
    """Embeddings, positions and a stack of layers: the part the three families share."""

    def __init__(self, *, vocab_size: int, d_model: int, layers: int, max_len: int, attention: Callable,
                 ffn: Callable, norm: Callable, pos: Callable, norm_placement: str, final_norm: bool | None,
                 embed_scale: bool, embed_norm: bool, dropout: float, layer: type, layer_kwargs: dict,
                 embedding: TokenEmbedding | None = None, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        if min(vocab_size, d_model, layers, max_len) < 1:
            raise ValueError(f"vocab_size, d_model, layers and max_len must be positive, got "
                             f"{vocab_size}, {d_model}, {layers}, {max_len}")
        self.embedding = embedding or TokenEmbedding(vocab_size, d_model, scale=embed_scale, **kw)
        self.pos = pos(**kw)
        self.embed_norm = norm(**kw) if embed_norm else None
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            layer(attention, ffn, norm, norm_placement, dropout, **layer_kwargs, **kw) for _ in range(layers))
        for index, module in enumerate(self.layers):
            module.self_attn.layer_index = index
            if getattr(module, "cross_attn", None) is not None:
                module.cross_attn.layer_index = index
        if final_norm is None:  # pre-norm leaves the last residual sum unnormalised; post-norm does not
            final_norm = norm_placement == "pre"
        self.final_norm = norm(**kw) if final_norm else None

    def embed(self, tokens: torch.Tensor, offset: int | torch.Tensor = 0,
              extra: torch.Tensor | None = None, *, check: bool = True) -> torch.Tensor:
        x = self.embedding(tokens, check=check)
        if extra is not None:
            x = x + extra
        x = self.pos(x, offset)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        return self.dropout(x)  # always called (once per pass): task=compare reads the embeddings off this module

    def run(self, x: torch.Tensor, **layer_inputs) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, positions=self.pos, **layer_inputs)
        return x if self.final_norm is None else self.final_norm(x)



class _Family(nn.Module):
    """What the three families share: the settings their stacks are built from, the attributes the tasks read
    (vocab_size, max_len, pad_id, d_model), the weights' initialisation and the LM head. Each family keeps its own
    constructor (Hydra builds it by keyword from conf/)."""

    def __init__(self, *, vocab_size: int, d_model: int, max_len: int, pad_id: int, device=None, dtype=None,
                 **stack_settings):
        super().__init__()
        self.vocab_size, self.max_len, self.pad_id, self.d_model = vocab_size, max_len, pad_id, d_model
        self._stack_settings = dict(vocab_size=vocab_size, d_model=d_model, max_len=max_len, device=device,
                                    dtype=dtype, **stack_settings)

    def _stack(self, layers: int, layer: type, embedding: TokenEmbedding | None = None, **layer_kwargs) -> _Stack:
        """A stack of ``layers`` layers of type ``layer`` (built with ``layer_kwargs``) on the family's settings."""
        return _Stack(layers=layers, layer=layer, layer_kwargs=layer_kwargs, embedding=embedding,
                      **self._stack_settings)

    def _init_weights(self) -> None:
        # GPT-2/BERT: N(0, 0.02) for matrices and embeddings. With sqrt(d) embedding scaling
        # (Vaswani) embeddings start at N(0, 1/d) so the scaled token input has unit variance.
        if any(p.device.type == "meta" for p in self.parameters()):   # shapes only: no values to draw
            return
        embedding_std = self.d_model ** -0.5 if self._stack_settings["embed_scale"] else 0.02
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=embedding_std)

    def _add_lm_head(self, tie_head: bool) -> None:
        """The last part of a family that predicts tokens: the LM head, the weights' initialisation, then the tie
        of the head to the decoder's embedding."""
        self.lm_head = nn.Linear(self.d_model, self.vocab_size, bias=False, device=self._stack_settings["device"],
                                 dtype=self._stack_settings["dtype"])
        self._init_weights()
        if tie_head:
            self.lm_head.weight = self.decoder.embedding.weight


class EncoderOnly(_Family):
    kind = "encoder_only"

    def __init__(self, vocab_size: int, d_model: int, layers: int, max_len: int, attention: Callable,
                 ffn: Callable, norm: Callable, pos: Callable, norm_placement: str = "post",
                 final_norm: bool | None = None, embed_scale: bool = False, embed_norm: bool = False,
                 type_vocab_size: int = 0, pooler: bool = False, head_classes: int = 0,
                 dropout: float = 0.0, pad_id: int = 0, *, device=None, dtype=None):
        super().__init__(vocab_size=vocab_size, d_model=d_model, max_len=max_len, pad_id=pad_id, attention=attention,
                         ffn=ffn, norm=norm, pos=pos, norm_placement=norm_placement, final_norm=final_norm,
                         embed_scale=embed_scale, embed_norm=embed_norm, dropout=dropout, device=device, dtype=dtype)
        kw = dict(device=device, dtype=dtype)
        self.encoder = self._stack(layers, EncoderLayer)
        self.token_types = embedding_table(type_vocab_size, d_model, **kw) if type_vocab_size else None
        self.pooler = nn.Linear(d_model, d_model, **kw) if pooler else None
        self.head = nn.Linear(d_model, head_classes, **kw) if head_classes else None
        self._init_weights()

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None,
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        types = None
        if self.token_types is not None:
            types = self.token_types(torch.zeros_like(tokens) if token_types is None else token_types)
        x = self.encoder.run(self.encoder.embed(tokens, extra=types), mask=mask)
        return x if self.head is None else self.head(x)

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """BERT's pooler: tanh(W h_0 + b) on the first token's hidden state."""
        if self.pooler is None:
            raise ValueError("this model was built with pooler=false")
        return torch.tanh(self.pooler(hidden[:, 0]))


class DecoderOnly(_Family):
    kind = "decoder_only"

    def __init__(self, vocab_size: int, d_model: int, layers: int, max_len: int, attention: Callable,
                 ffn: Callable, norm: Callable, pos: Callable, norm_placement: str = "pre",
                 final_norm: bool | None = None, embed_scale: bool = False, embed_norm: bool = False,
                 tie_head: bool = True, dropout: float = 0.0, pad_id: int = 0, *, device=None, dtype=None):
        super().__init__(vocab_size=vocab_size, d_model=d_model, max_len=max_len, pad_id=pad_id, attention=attention,
                         ffn=ffn, norm=norm, pos=pos, norm_placement=norm_placement, final_norm=final_norm,
                         embed_scale=embed_scale, embed_norm=embed_norm, dropout=dropout, device=device, dtype=dtype)
        self.decoder = self._stack(layers, DecoderLayer, cross_attention=False)
        self._add_lm_head(tie_head)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None,
                cache: KVCache | None = None, *, segments: torch.Tensor | None = None,
                check: bool = True) -> torch.Tensor:
        """With a cache, ``tokens`` are the next positions and ``mask`` covers all positions so far.

        segments (b, l): packed rows (zoo.nn.packing.Packing): the index of each token's sequence in its row,
        -1 on padding; every sequence is then computed as if alone (its own positions from 0, attention within it).
        check=False: the ids are known to lie in the vocabulary (a decoding step fed the model's own picks), so
        they are not read back from the device (TokenEmbedding.check)."""
        offset, layer_inputs = (cache.begin(tokens.shape[1], mask) if cache is not None else 0), {}
        if segments is not None:
            if cache is not None:
                raise ValueError("segments (packed rows) are for training and scoring, not cached decoding")
            packing = Packing.from_segments(segments)
            offset, layer_inputs = packing.positions, {"packing": packing}
        x = self.decoder.run(self.decoder.embed(tokens, offset, check=check), mask=mask, cache=cache,
                             **layer_inputs)
        if cache is not None:
            cache.finish(tokens.shape[1])
        return self.lm_head(x)


class EncoderDecoder(_Family):
    kind = "encoder_decoder"

    def __init__(self, vocab_size: int, d_model: int, layers: int, max_len: int, attention: Callable,
                 ffn: Callable, norm: Callable, pos: Callable, decoder_layers: int | None = None,
                 norm_placement: str = "post", final_norm: bool | None = None, embed_scale: bool = True,
                 embed_norm: bool = False, share_embeddings: bool = True, tie_head: bool = True,
                 dropout: float = 0.0, pad_id: int = 0, *, device=None, dtype=None):
        super().__init__(vocab_size=vocab_size, d_model=d_model, max_len=max_len, pad_id=pad_id, attention=attention,
                         ffn=ffn, norm=norm, pos=pos, norm_placement=norm_placement, final_norm=final_norm,
                         embed_scale=embed_scale, embed_norm=embed_norm, dropout=dropout, device=device, dtype=dtype)
        self.encoder = self._stack(layers, EncoderLayer)
        self.decoder = self._stack(layers if decoder_layers is None else decoder_layers, DecoderLayer,
                                   self.encoder.embedding if share_embeddings else None, cross_attention=True)
        self._add_lm_head(tie_head)

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor | None = None, *, check: bool = True) -> torch.Tensor:
        return self.encoder.run(self.encoder.embed(src, check=check), mask=src_mask)

    def decode(self, tgt: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor | None = None,
               tgt_mask: torch.Tensor | None = None, cache: KVCache | None = None, *,
               check: bool = True) -> torch.Tensor:
        offset = cache.begin(tgt.shape[1], tgt_mask) if cache is not None else 0
        x = self.decoder.run(self.decoder.embed(tgt, offset, check=check), memory=memory, mask=tgt_mask,
                             memory_mask=src_mask, cache=cache)
        if cache is not None:
            cache.finish(tgt.shape[1])
        return self.lm_head(x)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_mask: torch.Tensor | None = None,
                tgt_mask: torch.Tensor | None = None) -> torch.Tensor:
        # Both token tensors checked before any kernel runs: the decoder's own check, after the encoder, would make
        # the host wait for the encoder's kernels on a GPU (a synchronisation in the middle of the forward pass).
        self.decoder.embedding.check(src, tgt)
        return self.decode(tgt, self.encode(src, src_mask, check=False), src_mask, tgt_mask, check=False)
