"""The spec suite's pytest plug-in: the entry point (pyproject.toml, pytest11 ``properties.plugin``) that pytest
loads in every run of an environment where the package is installed, in any project.

It imports pytest, the standard library, the option lists of properties/core/options.py and the suite's place
(properties/core/levels.py; both import nothing else), and registers the suite's options (``pytest --help``: groups "spec properties" and "models"). Torch, Hydra, the zoo and the suite
load only in a run that asks for them: one that collects the suite (``targets_suite``: a path inside properties/,
a path that holds it, or ``--pyargs properties``), or gives one of these options a value other than its default.
There, at configuration and before Hypothesis' plug-in reads ``--hypothesis-profile`` (which may name the suite's
profiles), properties/plugin/suite.py is imported and registers the suite's hooks and fixtures. A run that loaded
nothing and collects a clause module all the same (through a link into properties/, say) stops with a usage error
that says how to name the suite.

Which clauses run: with --kernel alone the kernel clauses; with --model the model clauses (and the kernel
clauses too if --kernel is also given); with --zoo, or with no plug-in option, every level. The Hypothesis
profiles (Hypothesis' own ``--hypothesis-profile``: default, ci, thorough, quick, pinned), the run's seed and
SIGTERM are properties/plugin/session.py's; the clause text of a failure and --report-json are
properties/plugin/report.py's; the watchdog of --call-timeout is properties/plugin/watchdog.py.
"""
from __future__ import annotations

import functools
import importlib
from pathlib import Path

import pytest

from properties.core.levels import LEVELS, SUITE_DIR
from properties.core.options import (ALIGNMENTS, DEFAULT_TIMEOUT, DTYPE_NAMES, FINFO_MIN_ROWS,
                                     FULLY_MASKED_CONVENTIONS, KERNEL_APIS, LSE_BASES, MIN_TIMEOUT, SHARD_LAYOUTS)

__all__ = ["OPTIONS", "DEFAULTS", "SUITE_PLUGIN", "targets_suite", "options_given"]

SUITE_PLUGIN = "properties.plugin.suite"   # the module, and its name among pytest's plug-ins once registered
_SPEC = ("spec properties", "kernel and options for the spec suites in properties/")
_MODELS = ("models", "model-level clauses (properties/SPEC.md, section Models)")

# Every option of the suite: (group, names, argparse keywords). pytest_addoption registers them in this order.
OPTIONS = (
    (_SPEC, ("--kernel",), dict(
        action="append", metavar="SPEC",
        help="kernel under test (repeatable): a zoo backend by name (zoo.nn.kernel.KERNELS: math, torch, ...), "
             "'pkg.module:function' or 'path/to/file.py:function'; default: every zoo backend")),
    (_SPEC, ("--device",), dict(
        action="append", metavar="DEVICE",
        help="device to test on (repeatable): cpu, cuda, cuda:N; default: every available device")),
    (_SPEC, ("--dtype",), dict(action="append", choices=DTYPE_NAMES, help="dtype to draw (repeatable); default: all")),
    (_SPEC, ("--causal-alignment",), dict(
        choices=ALIGNMENTS, default="top-left",
        help="is_causal diagonal for L != S: top-left (PyTorch, default) or bottom-right (FlashAttention)")),
    (_SPEC, ("--fully-masked",), dict(
        choices=FULLY_MASKED_CONVENTIONS, default="zeros",
        help="output required for a query with no admissible key: zeros (default), nan, mean (of the values, as an "
             "additive finfo.min mask gives) or any (no requirement)")),
    (_SPEC, ("--finfo-min-rows",), dict(
        choices=FINFO_MIN_ROWS, default="softmax",
        help="a float-mask row whose every score lies below -finfo(float32).max/log2(e) (finfo.min in float32 or "
             "bfloat16): softmax (default, SDPA's semantics: the softmax of the row's scores) or masked (it may also "
             "come out as a query without admissible key, per --fully-masked: PyTorch's memory-efficient CUDA "
             "kernel; MASK-LOW-PRECISION)")),
    (_SPEC, ("--report-json",), dict(
        metavar="PATH", help="write a JSON list of {clause, title, status, nodeid, duration_s, message}")),
    (_SPEC, ("--repro-dir",), dict(
        metavar="DIR",
        help="write <clause>-<n>.py for each failing clause into a fresh subdirectory of DIR (DIR/run-<date>-<time>): "
             "a script that needs only torch and the code under test, exits 1 while the failure is there, 0 once it "
             "is fixed, 2 if it cannot run")),
    (_SPEC, ("--kernel-api",), dict(
        choices=KERNEL_APIS, default="sdpa",
        help="calling convention of --kernel: sdpa (default, the SDPA signature), flash-attn 2.x's flash, "
             "flash-varlen, flash-kvcache, or merge (FlashInfer's merge_state(v_a, s_a, v_b, s_b) or "
             "merge_states(v, s)); a flash or merge API without --kernel checks the zoo's kernels")),
    (_SPEC, ("--window-right-below-lk",), dict(
        action="store_true",
        help="flash clauses: draw windows with 0 <= right < Lk only (where flash-attn 2's CUDA kernel follows its "
             "docstring)")),
    # The limits of an SDPA kernel (properties/core/options.py: LIMIT_OPTIONS; properties/kernel/limits.py).
    (_SPEC, ("--kernel-head-size",), dict(
        action="append", metavar="N",
        help="a head size E the SDPA kernel accepts (repeatable, or comma-separated: 16,32,64,128); the kernel "
             "clauses draw only these. Default: any")),
    (_SPEC, ("--kernel-no-mask",), dict(
        action="store_true",
        help="the SDPA kernel accepts no attn_mask: the mask clauses are skipped, the others draw none")),
    (_SPEC, ("--kernel-equal-lengths",), dict(
        action="store_true", help="the SDPA kernel accepts only L = S (as many queries as keys)")),
    (_SPEC, ("--kernel-equal-head-sizes",), dict(
        action="store_true",
        help="the SDPA kernel accepts only Ev = E (value head size equal to the query/key head size); the weights "
             "are then read through V = I in slices of E columns")),
    # Declared contracts (properties/plugin/contracts.py): their clauses are skipped without the option.
    (_SPEC, ("--deterministic",), dict(
        action="store_true",
        help="declare that every kernel or model call, and its backward, is bitwise equal when repeated on the same "
             "inputs (KERNEL-DETERMINISTIC, MODEL-DETERMINISTIC; skipped without it)")),
    (_SPEC, ("--batch-invariant",), dict(
        action="store_true",
        help="declare that a sequence's output is bitwise the same whatever else is in its batch and wherever it "
             "sits (KERNEL-BATCH-INVARIANT, MODEL-BATCH-INVARIANT; skipped without it)")),
    # ---- Partial states and attention split across ranks (properties/distributed/, properties/kernel/test_lse.py,
    # test_merge.py; docs/distributed.md).
    (_SPEC, ("--world-size",), dict(
        default=None, metavar="W",
        help="verify --kernel as a context-parallel kernel on W ranks (kernel(q, k, v, is_causal=, scale=, "
             "enable_gqa=, group=) on each rank's shard): the distributed clauses only; gloo on the CPU, NCCL on W "
             "GPUs; under torchrun the suite joins its group. Without --kernel: the zoo's ring, zigzag, ulysses and "
             "allgather_kv")),
    (_SPEC, ("--shard",), dict(
        choices=SHARD_LAYOUTS, default="contiguous",
        help="how the ranks hold the sequence (--world-size): contiguous (default; rank r holds rows r*L/W ... "
             "(r+1)*L/W - 1) or zigzag (2W chunks, rank r holds chunks r and 2W-1-r)")),
    (_SPEC, ("--master-port",), dict(
        default=None, metavar="PORT",
        help="TCP port of the ranks' rendezvous on 127.0.0.1 (--world-size); default: one the system picks free")),
    (_SPEC, ("--returns-lse",), dict(
        action="store_true",
        help="the SDPA kernel returns (output, lse), lse (..., L) the log-sum-exp of each query's scores: the LSE "
             "clauses check it, the others read the output; without --kernel, zoo.nn.partial:attention_with_lse")),
    (_SPEC, ("--lse-base",), dict(
        choices=LSE_BASES, default="e",
        help="the base of the log-sum-exp a kernel returns or a merge kernel takes: e (default) or 2 (FlashInfer)")),
    # The watchdog (properties/plugin/watchdog.py).
    (_SPEC, ("--call-timeout", "--kernel-timeout"), dict(
        dest="call_timeout", default=None, metavar="SECONDS",
        help=f"time limit for one call of the code under test (a kernel call or its backward pass, a module's or "
             f"model's forward or decode step, importing a plug-in, a factory); a call past it fails its test and "
             f"that code is not called again; 0: no limit, else at least {MIN_TIMEOUT:g}; default "
             f"{DEFAULT_TIMEOUT:g}")),
    # The models under test (properties/model/subjects.py) and the references (properties/plugin/reference.py).
    (_MODELS, ("--model",), dict(
        default=None, metavar="pkg.module:factory",
        help="verify the model factory() returns (a zoo model or a properties.Subject); also "
             "path/to/file.py:factory")),
    (_MODELS, ("--zoo",), dict(
        default=None, metavar="OVERRIDES",
        help='verify the zoo model built from Hydra overrides, e.g. "model=decoder_only '
             'attention._target_=mypkg.MyAttention"')),
    (_MODELS, ("--zoo-config",), dict(
        default=None, metavar="PATH",
        help="verify the zoo model a saved config builds (a YAML such as `python -m zoo task=verify` writes); like "
             "--zoo, every level runs")),
    (_MODELS, ("--reference",), dict(
        default=None, metavar="FILE.py:FACTORY",
        help="a second model (pkg.module:factory or path/to/file.py:factory, called with no argument or with the "
             "Subject under test) that the model under test must agree with: MODEL-DIFF-FORWARD, -GRADIENT, "
             "-DECODE; 'upstream': transformers' own implementation of the model's config, with the model's weights")),
    (_MODELS, ("--reference-map",), dict(
        default=None, metavar="FILE.py:NAMES",
        help="with --reference upstream: how the model's weights are named upstream, a dict {upstream name: name} or "
             "a callable(state_dict) -> state_dict")),
    (_SPEC, ("--reference-kernel",), dict(
        default=None, metavar="SPEC",
        help="a kernel (a zoo backend such as math or torch, pkg.module:function or path/to/file.py:function) that "
             "each kernel under test must agree with, forward and backward: ATTN-DIFF, ATTN-DIFF-GRAD")),
)
# Each option's default, by its first name: a run that gives any option another value loads the suite.
DEFAULTS = {names[0]: keywords.get("default", False if keywords.get("action") == "store_true" else None)
            for _, names, keywords in OPTIONS}


def pytest_addoption(parser):
    for (name, description), names, keywords in OPTIONS:
        parser.getgroup(name, description).addoption(*names, **keywords)


def options_given(config) -> bool:
    """Whether the run gives one of the suite's options a value other than its default."""
    return any(config.getoption(name, default) != default for name, default in DEFAULTS.items())


def targets_suite(config, part: str | None = None) -> bool:
    """Whether this pytest run collects the spec suite (a path inside it, a path that holds it, or --pyargs
    properties): only then are the suite's Hypothesis profiles registered and ``default`` loaded, so that an
    unrelated test suite in an environment where the plug-in is installed keeps Hypothesis' own settings and
    profiles. With ``part`` (a level's folder, ``"kernel"``): whether it collects that folder of the suite."""
    suite = SUITE_DIR / part if part else SUITE_DIR
    package = f"properties.{part}" if part else "properties"
    for arg in config.args:
        name = arg.split("::")[0]
        if config.getoption("pyargs", False) and (name in ("properties", package) or name.startswith(package + ".")):
            return True
        path = (Path(config.invocation_params.dir) / name).resolve()
        if path == suite or suite in path.parents:
            return True
        if path in suite.parents:   # collected from above, unless it lies where pytest does not look
            hidden = [p for p in suite.relative_to(path).parts if p.startswith(".") or p.endswith("-packages")]
            if not hidden:
                return True
    return False


@pytest.hookimpl(tryfirst=True)   # before Hypothesis' plug-in loads --hypothesis-profile, which may name the suite's
def pytest_configure(config):
    config.addinivalue_line("markers", "clause(*ids): the spec clauses (properties/SPEC.md) a test checks")
    for level in LEVELS:
        config.addinivalue_line("markers", f"{level}: a {level}-level clause (properties/{level}/); "
                                           f"select with -m {level}")
    if targets_suite(config) or options_given(config):
        importlib.import_module(SUITE_PLUGIN).configure(config)


@functools.lru_cache(maxsize=None)
def _inside_suite(path: str) -> bool:
    """``properties.core.levels.in_suite`` for a test file, once per file: links resolved."""
    return SUITE_DIR in Path(path).resolve().parents


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """A clause module collected by a run that did not load the suite (pytest reached properties/ through a link,
    or a plug-in of its own): its tests would run without the suite's kernels, profiles and watchdog. A usage
    error, naming the way to run them."""
    if config.pluginmanager.has_plugin(SUITE_PLUGIN):
        return
    strays = sorted({str(item.path) for item in items if _inside_suite(str(item.path))})
    if strays:
        more = f" and {len(strays) - 1} more" if len(strays) > 1 else ""
        raise pytest.UsageError(f"{strays[0]}{more}: clause modules of the spec suite ({SUITE_DIR}), collected by a "
                                f"run that did not load the suite at its start (it names no path inside the suite "
                                f"or holding it, no --pyargs properties and no suite option); run them as "
                                f"`pytest {SUITE_DIR}` or `pytest --pyargs properties`")
