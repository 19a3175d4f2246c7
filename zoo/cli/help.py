"""What ``python -m zoo --help`` prints before Hydra's own help: the tasks, the config groups and their options, the
plug-in points and the suite's options, read from the packaged config tree (conf/, shipped as zoo.conf)."""
from __future__ import annotations

from zoo.runtime.call_limit import DEFAULT_TIMEOUT

__all__ = ["project_help"]

# `python -m zoo --help`: this project's help first, then Hydra's (config groups and the composed config).
TASK_WORDS = {
    "run": "the default: model card, a timed forward pass and a quick verification (task.verify=false skips it)",
    "summary": "the model card only, built on the meta device: any preset, no memory spent",
    "verify": "every applicable spec clause on the built model; report.json, report.md, junit.xml in the run dir",
    "compare": "a preset at reduced size against its reference: reference=hf (the hf extra) or reference=torch",
    "train": "train on a synthetic task (data=copy|reverse|sort|running_max); checkpoints in task.out_dir",
    "generate": "decode with a task=train checkpoint: task.checkpoint=DIR",
}
_GROUPS = {"model": "family", "attention": "kernel backend", "ffn": "feed-forward", "norm": "normalization",
           "pos": "positions", "preset": "sizes", "data": "task=train data", "experiment": "a training run"}


def _first_comment(text: str) -> str:
    lines = [line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("#") and "@package" not in line]
    return lines[0] if lines else ""


def project_help() -> str:
    """What `python -m zoo --help` prints before Hydra's help: tasks, groups, plug-in points, the suite's options.
    Tasks, groups, options and defaults are read from the packaged config tree (conf/, shipped as zoo.conf)."""
    from importlib.resources import files

    from omegaconf import OmegaConf

    from zoo.config.options import options
    from zoo.nn.kernel import KERNELS

    conf = files("zoo.conf")
    primary = OmegaConf.create((conf / "config.yaml").read_text())
    # unresolved: the recipe entry is a defaults-list interpolation that only Hydra's composition can resolve
    entries = OmegaConf.to_container(primary, resolve=False).get("defaults", [])
    defaults = {k: v for entry in entries if not isinstance(entry, str) for k, v in entry.items()}
    keys = [k for k in primary if k not in ("defaults", "hydra")]

    def listed(group: str) -> str:
        return ", ".join(f"{o} (default)" if o == defaults.get(group) else o for o in options(group))

    tasks = sorted(options("task"), key=lambda t: (t != defaults.get("task"), t not in TASK_WORDS, list(TASK_WORDS).index(t)
                                                   if t in TASK_WORDS else 0, t))
    width = max(map(len, tasks))
    task_lines = [f"  {t:<{width}}  {TASK_WORDS.get(t) or _first_comment((conf / 'task' / f'{t}.yaml').read_text())}"
                  for t in tasks]
    groups = [g for g in _GROUPS if g in {p.name for p in conf.iterdir()}]
    group_lines = [f"  {g:<10} {_GROUPS[g] + ':':<16} {listed(g)}" for g in groups]
    return "\n".join([
        "transformer-zoo: Transformers assembled from Hydra configs, checked against the spec (properties/SPEC.md).",
        "",
        "usage: python -m zoo [GROUP=OPTION ...] [KEY=VALUE ...] [task=TASK]   e.g. python -m zoo model=decoder_only heads=8",
        "       python -m zoo -m KEY=A,B ...                                   a sweep (multirun), one job per combination",
        "",
        f"tasks (task=...; default {defaults.get('task', 'run')}):",
        *task_lines,
        "",
        "config groups (GROUP=OPTION):",
        *group_lines,
        f"top-level keys (KEY=VALUE): {', '.join(keys)}",
        "task=train with the tiny preset also applies the recipe conf/recipe/train/tiny/MODEL/DATA.yaml where one",
        "exists (printed when training starts; a value on the command line wins; ~recipe drops it).",
        "",
        "plug-in points:",
        "  attention.kernel=pkg.mod:fn              any kernel with the signature of F.scaled_dot_product_attention",
        "                                           (also path/to/file.py:fn)",
        "  attention._target_=pkg.mod.MyAttention   your class in place of a part (likewise ffn., norm., pos._target_),",
        "                                           called with the node's keys plus device= and dtype=",
        f"  call_timeout=SECONDS                     time limit for one call of a plug-in: importing it, building the",
        f"                                           model, a forward pass, a decoding (default {DEFAULT_TIMEOUT:g}; 0: no",
        "                                           limit); past it, one line and exit status 1, also when stuck in C",
        "  allow_plugins=true                       let task=generate / task.resume=true import the plug-in paths a",
        "                                           checkpoint names (by default only the zoo's own classes and kernels)",
        "",
        "verify your own implementation with the spec suite (pytest; python -m properties ... is the same):",
        f"  pytest --pyargs properties --kernel pkg.mod:fn          the kernel clauses (or {'|'.join(sorted(KERNELS))})",
        "  pytest --pyargs properties --model pkg.mod:factory      the model clauses on a factory's model",
        '  pytest --pyargs properties --zoo "attention._target_=pkg.mod.MyAttention"   every level on a zoo model',
        "  options: --device, --dtype, --causal-alignment, --fully-masked, --report-json PATH, --hypothesis-profile",
        "",
        "Outputs go to Hydra's run directory (outputs/DATE/TIME; a sweep: multirun/DATE/TIME).",
        "",
        "Hydra's help follows.",
        "",
    ])
