"""A part of a model from its config node: the factory that model constructors and the size check call."""
from __future__ import annotations

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

__all__ = ["OFF_WHEN_NULL", "instantiate_part"]

# Features of a part that are off while null (the attention's FlashAttention options). While null they are not
# passed to the constructor (instantiate_part), so a replacement class (`attention._target_=...`) written without
# them still builds; set, they are checked and passed like any key.
OFF_WHEN_NULL = ("window", "softcap")


def instantiate_part(node: DictConfig):
    """The part's factory: ``instantiate(node)`` without the OFF_WHEN_NULL keys that are null."""
    unset = [key for key in OFF_WHEN_NULL if key in node and node[key] is None]
    if not unset:
        return instantiate(node)
    values = OmegaConf.to_container(node, resolve=True)
    return instantiate({key: value for key, value in values.items() if key not in unset})
