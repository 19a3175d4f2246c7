"""Weights in and out of the zoo: Hugging Face GPT-2 and BERT, torch.nn.Transformer and nn.MultiheadAttention (user
checkpoints, safetensors or torch.save files read with weights_only=True, are zoo.io.weights).

Converters work on state dicts (str -> Tensor) and a ``Geometry`` that says which zoo model the
weights fit; ``zoo_*_from_*`` helpers build the matching model and load it.

    Hugging Face GPT2LMHeadModel  <->  DecoderOnly     (gpt2_to_zoo / zoo_to_gpt2)
    Hugging Face BertModel        <->  EncoderOnly     (bert_to_zoo / zoo_to_bert, a pure renaming)
    torch.nn.Transformer           ->  EncoderDecoder  (torch_transformer_to_zoo)
    nn.MultiheadAttention          ->  MultiHeadAttention (mha_to_zoo)

Returned tensors may share memory with the input state dict; loading them copies.
``transformers`` is optional: it is imported only by the functions that build Hugging Face objects.
"""
from zoo.interop.bert import bert_geometry, bert_to_zoo, hf_bert_config, hf_bert_from_zoo, zoo_bert_from_hf, zoo_to_bert
from zoo.interop.geometry import ConversionError, Geometry, zoo_geometry
from zoo.interop.gpt2 import gpt2_geometry, gpt2_to_zoo, hf_gpt2_config, hf_gpt2_from_zoo, zoo_gpt2_from_hf, zoo_to_gpt2
from zoo.interop.torch_nn import (TorchTransformerReference, mha_to_zoo, torch_transformer_geometry,
                                  torch_transformer_to_zoo, zoo_attention_from_mha, zoo_from_torch_transformer)

__all__ = [
    "Geometry", "ConversionError", "zoo_geometry",
    "gpt2_geometry", "gpt2_to_zoo", "zoo_to_gpt2", "zoo_gpt2_from_hf", "hf_gpt2_config", "hf_gpt2_from_zoo",
    "bert_geometry", "bert_to_zoo", "zoo_to_bert", "zoo_bert_from_hf", "hf_bert_config", "hf_bert_from_zoo",
    "TorchTransformerReference", "torch_transformer_geometry", "torch_transformer_to_zoo",
    "zoo_from_torch_transformer", "mha_to_zoo", "zoo_attention_from_mha",
]

