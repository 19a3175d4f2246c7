"""The options of each task (``task=NAME``: TASK_SCHEMAS) and of the synthetic data (``data=NAME``: DataOptions),
and their checks beyond types; zoo/config/schema.py holds the schema of the model and its parts, and ``validate``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from zoo.config.errors import refuse_value
from zoo.config.options import DATA_TASKS, MAX_LAYERS, SEED_RANGE
from zoo.runtime.plugins import locate

__all__ = ["TASK_SCHEMAS", "DataOptions", "PROFILES", "COMPILE_MODES", "RunTask", "VerifyTask", "SummaryTask",
           "TrainTask", "GenerateTask", "CompareTask", "check_task", "check_seed", "check_applies", "override_key",
           "READS"]

PROFILES = ("quick", "default", "ci", "thorough")  # Hypothesis profiles of properties/plugin/session.py
# task.compile (zoo/tasks/generate.py): torch.compile's inductor modes, and aot_eager, which traces without
# generating code (a check that the step compiles whole, as the CPU tests use it).
COMPILE_MODES = ("reduce-overhead", "default", "max-autotune", "max-autotune-no-cudagraphs", "aot_eager")


@dataclass
class RunTask:
    name: str = "run"
    batch: int = 2
    seq_len: int = 32
    verify: bool = True         # then a quick verification of the assembled model (task=verify does it fully)
    profile: str = "quick"


@dataclass
class VerifyTask:
    """Options of task=verify (zoo/tasks/verify.py): the Hypothesis profile the suite runs with."""
    name: str = "verify"
    profile: str = "default"


@dataclass
class SummaryTask:
    name: str = "summary"


@dataclass
class TrainTask:
    """Options of task=train (zoo/tasks/train.py); the model's vocab_size and max_len are derived from the data."""
    name: str = "train"
    steps: int = 2000
    batch: int = 64
    lr: float = 1e-3
    warmup: int = 100           # linear warm-up steps, then cosine decay to min_lr_ratio * lr at `steps`
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01  # on matrices and embeddings only, never on biases and norms
    clip: float = 1.0           # max global gradient norm
    eval_every: int = 200
    eval_batches: int = 4       # held-out sequences per evaluation: eval_batches * batch
    checkpoint_every: int = 500
    out_dir: str = "${hydra:runtime.output_dir}"  # the current directory when not run by Hydra
    resume: bool = False        # continue from the last checkpoint in out_dir
    keep: int = 2               # checkpoints kept in out_dir (older ones are deleted)
    packing: bool = False       # decoder_only: pack the sequences of a batch into rows (zoo.tasks.data.pack)


@dataclass
class GenerateTask:
    """Options of task=generate (zoo/tasks/generate.py): decode with the model and data of a train checkpoint."""
    name: str = "generate"
    checkpoint: str = ""        # a train out_dir (its last checkpoint) or one step-NNNNNNN directory
    samples: int = 8            # held-out prompts to decode when no prompt is given
    prompt: str = ""            # symbols separated by spaces, e.g. "3 1 4 1 5"; empty: held-out samples
    max_new: Optional[int] = None  # null: the longest answer plus EOS
    temperature: float = 0.0    # 0: greedy
    top_k: Optional[int] = None  # null: sample from the whole vocabulary
    cache: bool = True          # incremental decoding with a KV cache (false: recompute the prefix)
    block_size: Optional[int] = None  # a paged KV cache of blocks of this many positions; null: contiguous
    compile: Optional[str] = None  # compile the decoding step: one of COMPILE_MODES; null: eager
    seed: int = 0


@dataclass
class CompareTask:
    """Options of task=compare (zoo/tasks/compare.py): the reduced size both models are built at."""
    name: str = "compare"
    layers: int = 2
    d_model: int = 64
    heads: int = 4
    vocab_size: int = 512
    max_len: int = 64
    batch: int = 3
    seq_len: int = 16
    padding: bool = True


TASK_SCHEMAS: dict[str, type] = {"verify": VerifyTask, "compare": CompareTask, "run": RunTask, "summary": SummaryTask, "train": TrainTask,
                                 "generate": GenerateTask}


@dataclass
class DataOptions:
    name: str = MISSING
    vocab: int = 16
    min_len: int = 8
    max_len: int = 16
    seed: int = 0


# Ranges of float (and optional) task options that a type cannot say; checked for any task that has them.
_TASK_RANGES = {
    "lr": (lambda v: v > 0, "must be positive"),
    "min_lr_ratio": (lambda v: 0 <= v <= 1, "must lie in [0, 1]"),
    "weight_decay": (lambda v: v >= 0, "must be non-negative"),
    "clip": (lambda v: v > 0, "must be positive"),
    "temperature": (lambda v: v >= 0, "must be non-negative (0 is greedy)"),
    "top_k": (lambda v: v is None or v >= 1, "must be a positive integer or null"),
    "max_new": (lambda v: v is None or v >= 1, "must be a positive integer or null"),
    "block_size": (lambda v: v is None or v >= 1, "must be a positive integer or null (a contiguous KV cache)"),
    "compile": (lambda v: v is None or v in COMPILE_MODES,
                f"expected null (eager) or one of {', '.join(COMPILE_MODES)}"),
}


def check_seed(key: str, value: int) -> None:
    low, high = SEED_RANGE
    if not low <= value <= high:
        refuse_value(key, value, f"outside torch's seed range (allowed: {low} to {high})")


def check_task(cfg: DictConfig) -> None:
    """The task node against the schema of its task and the ranges types cannot say, then the data node."""
    name = cfg.task.get("name")
    if name not in TASK_SCHEMAS:
        refuse_value("task", name, f"unknown task (allowed: {', '.join(TASK_SCHEMAS)})")
    schema = TASK_SCHEMAS[name]
    allowed = {f.name for f in fields(schema)}
    for f in fields(schema):
        if f.name not in cfg.task:
            _missing(f"task.{f.name}", f"task={name}")
    for key in cfg.task:
        if key not in allowed:
            refuse_value(f"task.{key}", cfg.task[key],
                         f"not an option of task {name} (allowed: {', '.join(sorted(allowed))})")
    try:
        OmegaConf.merge(OmegaConf.structured(schema), cfg.task)
    except Exception as exc:
        key = getattr(exc, "full_key", "") or "task"
        refuse_value(f"task.{key}" if not key.startswith("task") else key, cfg.task.get(key.split(".")[-1]),
                     str(exc).splitlines()[0])
    if "profile" in allowed and cfg.task.profile not in PROFILES:
        refuse_value("task.profile", cfg.task.profile, f"unknown profile (allowed: {', '.join(PROFILES)})")
    for f in fields(schema):
        if f.type in (int, "int") and f.name != "seed" and cfg.task.get(f.name, 1) < 1:
            refuse_value(f"task.{f.name}", cfg.task[f.name], "must be a positive integer")
    for key in cfg.task:
        if OmegaConf.is_interpolation(cfg.task, key):  # out_dir=${hydra:...}: resolved only inside a Hydra run
            continue
        value = cfg.task[key]
        if isinstance(value, float) and not math.isfinite(value):
            refuse_value(f"task.{key}", value, "must be a finite number")
    for key, (ok, allowed) in _TASK_RANGES.items():
        if key in cfg.task and not ok(cfg.task[key]):
            refuse_value(f"task.{key}", cfg.task[key], allowed)
    if cfg.task.get("block_size") is not None and not cfg.task.get("cache", True):
        refuse_value("task.block_size", cfg.task.block_size, "pages the KV cache, and task.cache=false decodes "
                                                             "without one (set task.cache=true or "
                                                             "task.block_size=null)")
    paged_or_none = cfg.task.get("block_size") is not None or not cfg.task.get("cache", True)
    if cfg.task.get("compile") is not None and paged_or_none:
        refuse_value("task.compile", cfg.task.compile, "compiles the step of the static KV cache (task.cache=true, "
                                                       "task.block_size=null)")
    if cfg.task.get("packing") and getattr(locate(cfg.model._target_), "kind", None) != "decoder_only":
        refuse_value("task.packing", cfg.task.packing, "packs decoder_only sequences (model=decoder_only); an "
                                                       "encoder's batches keep one sequence per row")
    if "seq_len" in cfg.task:
        limit, limit_key = (cfg.task.max_len, "task.max_len") if "max_len" in cfg.task else (cfg.max_len, "max_len")
        if cfg.task.seq_len > limit:
            refuse_value("task.seq_len", cfg.task.seq_len, f"beyond {limit_key}={limit}, the longest sequence the "
                                                           f"model's positions cover (lower task.seq_len or raise "
                                                           f"{limit_key})")
    if "seed" in cfg.task:
        check_seed("task.seed", cfg.task.seed)
    if name == "compare":
        _check_compare(cfg.task)
    if cfg.get("reference") is not None:
        if name != "compare":
            refuse_value("reference", cfg.reference, f"only task=compare compares with a reference, not task={name}")
        if cfg.reference not in ("hf", "torch"):
            refuse_value("reference", cfg.reference, "no such reference (allowed: hf, torch)")
    if cfg.get("allow_plugins") and not (name == "generate" or (name == "train" and cfg.task.get("resume"))):
        refuse_value("allow_plugins", "true", f"lets a checkpoint that is loaded import its plug-ins, and task={name} "
                                            f"loads none (allowed with task=generate or task=train task.resume=true)")
    if "data" in cfg and not OmegaConf.is_missing(cfg, "data"):
        _check_data(cfg.data)


def _check_compare(task: DictConfig) -> None:
    """What zoo.tasks.compare.run_compare needs of its sizes: both models are built at them."""
    if task.layers > MAX_LAYERS:
        refuse_value("task.layers", task.layers, f"more layers than a stack may have (allowed: 1 to {MAX_LAYERS})")
    if task.d_model % task.heads:
        refuse_value("task.heads", task.heads, f"must divide task.d_model={task.d_model}")
    if task.seq_len < 2:
        refuse_value("task.seq_len", task.seq_len, "must be at least 2 (the target is seq_len - 3 tokens, at least 2)")


# What each task reads besides its own task.* options (and Hydra's hydra.*). A key named on the command line that
# the chosen task does not read is refused: a value is never accepted and then ignored.
_MODEL = frozenset({"d_model", "heads", "kv_heads", "layers", "d_ff", "vocab_size", "max_len", "dropout",
                    "norm_placement", "dtype", "model", "attention", "ffn", "norm", "pos", "preset",
                    "experiment"})
READS = {
    "run": _MODEL | {"device", "seed"},
    "verify": _MODEL | {"device", "seed"},
    "summary": _MODEL | {"device", "seed"},
    "train": _MODEL | {"device", "seed", "data", "recipe", "allow_plugins"},
    "generate": frozenset({"device", "allow_plugins"}),
    "compare": frozenset({"preset", "reference", "seed"}),
}
_WHY = {
    "generate": "which decodes with the model and data saved in task.checkpoint",
    "compare": "which builds the preset and its reference at the sizes task.* gives, in float32 and float64 on the "
               "CPU",
    "data": "data is what task=train learns",
    "recipe": "a recipe sets up a task=train run",
}
_ALWAYS = frozenset({"task", "hydra", "reference", "allow_plugins"})  # checked by check_task for every task


def override_key(word: str) -> str:
    """The top-level key or group an override names: `heads` for `heads=8`, `attention` for
    `~attention.window`, `hydra` for `hydra/launcher=joblib`, `model` for `model@x=...`."""
    key = word.partition("=")[0].lstrip("+~")
    for separator in (".", "/", "@"):
        key = key.split(separator)[0]
    return key


def check_applies(cfg: DictConfig, overrides) -> None:
    """Refuse an override of a key the task does not read (e.g. `heads=8 task=generate`, `data=sort task=run`)."""
    name = cfg.task.get("name")
    reads = READS.get(name)
    if reads is None:
        return
    for word in overrides:
        key = override_key(word)
        if key in _ALWAYS or key in reads or key not in READS["train"] | READS["compare"]:
            continue
        if word.startswith("~") and key in ("recipe", "experiment"):  # dropping what does not apply is harmless
            continue
        why = _WHY.get(name) or _WHY.get(key, "")
        refuse_value(word.lstrip("+~").partition("=")[0], word.partition("=")[2] or "(removed)",
                     f"not read by task={name}, {why} (allowed with task={name}: task.*, {', '.join(sorted(reads))})")


def _missing(key: str, who: str) -> None:
    from zoo.config.errors import ConfigError
    raise ConfigError(f"{key}: missing, and {who} needs it (set {key}=VALUE)")


def _check_data(data: DictConfig) -> None:
    if data.get("name") not in DATA_TASKS:
        refuse_value("data", data.get("name"), f"unknown data (allowed: {', '.join(DATA_TASKS)})")
    allowed = {f.name for f in fields(DataOptions)}
    for f in fields(DataOptions):
        if f.name not in data:
            _missing(f"data.{f.name}", f"data={data.name}")
    for key in data:
        if key not in allowed:
            refuse_value(f"data.{key}", data[key], f"not an option of the data (allowed: {', '.join(sorted(allowed))})")
    try:
        OmegaConf.merge(OmegaConf.structured(DataOptions), data)
    except Exception as exc:
        key = str(getattr(exc, "full_key", "") or "").split(".")[-1]
        refuse_value(f"data.{key}" if key else "data", data.get(key, ""), str(exc).splitlines()[0])
    for key in ("vocab", "min_len"):
        if data[key] < 1:
            refuse_value(f"data.{key}", data[key], "must be a positive integer")
    if data.max_len < data.min_len:
        refuse_value("data.max_len", data.max_len, f"must be at least data.min_len={data.min_len}")
