"""The zoo's option lists, each stated once: the part groups, the dtypes, and the options of each config group
(read from the packaged config tree, so a new file under conf/pos/ is a new position option everywhere)."""
from __future__ import annotations

from importlib.resources import files

import torch

__all__ = ["PARTS", "DTYPES", "options", "FAMILIES", "POSITIONS", "MAX_LAYERS", "SEED_RANGE", "SEQUENCE_TASKS",
           "LABEL_TASKS", "DATA_TASKS"]

PARTS = ("attention", "ffn", "norm", "pos")  # the config groups a model is assembled from
# The deepest stack a config may ask for. Each layer is a dozen torch modules built one at a time (a millisecond
# or more each, on the meta device too): 10^9 layers would build for weeks. The deepest published Transformers
# have about a thousand layers (DeepNet, Wang et al. 2022).
MAX_LAYERS = 4096
SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.manual_seed and torch.Generator.manual_seed accept
# The synthetic data tasks (zoo/tasks/data.py makes them): here so that the task schemas check data.name without
# importing the tasks.
SEQUENCE_TASKS = ("copy", "reverse", "sort")
LABEL_TASKS = ("running_max",)
DATA_TASKS = SEQUENCE_TASKS + LABEL_TASKS
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def options(group: str) -> tuple[str, ...]:
    """The options of a config group, e.g. options("pos") -> ('learned', 'none', 'rotary', 'sinusoidal')."""
    return tuple(sorted(p.name.removesuffix(".yaml") for p in (files("zoo.conf") / group).iterdir()
                        if p.name.endswith(".yaml")))


FAMILIES = options("model")     # encoder_only, decoder_only, encoder_decoder
POSITIONS = options("pos")
