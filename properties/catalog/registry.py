"""Where each catalog entry is declared: beside the implementation it names, by one decorator.

    @bug("ATTN-ROWSUM", "ATTN-ORACLE", mechanism="softmax normalizes over the query axis, not the keys",
         instance="softmax_over_queries")
    class _SoftmaxOverQueries(StepwiseAttention): ...

    @bug("MODEL-PADDING", level="model", mechanism="the padding mask applied to the queries, not the keys")
    def query_padding_mask(): ...

    @module_bug("ffn_without_activation", "ffn._target_={target}", "FFN-FORMULA", mechanism="...")
    class FeedForwardWithoutActivation(FeedForward): ...

    @correct("stepwise", mechanism="the SDPA contract step by step", instance="stepwise_attention")
    class StepwiseAttention: ...

A decorator returns what it decorates unchanged and records an ``Entry``: the name, the level, the mechanism, the
clauses that must catch it and the command-line words that plug it in, computed from where the object is defined
(``module:name``; ``instance`` names the module attribute a decorated class is instantiated as). ``declare`` records a
ready ``Entry`` for an implementation defined outside the catalog (PyTorch's SDPA, the zoo's kernels, examples/).
``properties.catalog`` imports the modules that declare entries and reads them with ``entries``.
"""
from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from properties.core.levels import LEVELS

__all__ = ["Entry", "bug", "module_bug", "correct", "declare", "entries", "FLASH_APIS", "KERNEL_APIS"]

FLASH_APIS = ("flash", "flash-varlen", "flash-kvcache")
# The calling conventions besides SDPA's, each plugged in as --kernel-api=API --kernel=SPEC: FlashAttention's and the
# merge of partial states (FlashInfer's merge_state).
KERNEL_APIS = (*FLASH_APIS, "merge")
_FLASH_OPTIONS = tuple(f"--kernel-api={api}" for api in KERNEL_APIS)
T = TypeVar("T")


@dataclass(frozen=True)
class Entry:
    """One implementation under test, plugged in as a user would: ``pytest properties/ OPTION ARGUMENT``.

    level: kernel | module | model | distributed — which clauses concern it (the suite's kernel, module, model or
    distributed tests; a distributed entry is a context-parallel kernel, ``--kernel SPEC`` with ``--world-size W``
    and any ``--shard`` among its extra words).
    expected: clause IDs whose statements the bug violates (empty for a correct implementation).
    """
    name: str
    level: str
    mechanism: str
    expected: tuple[str, ...]
    option: str       # --kernel | --zoo | --model ("" for the plain run on the zoo's own parts)
    argument: str
    extra: tuple[str, ...] = ()   # further words after OPTION ARGUMENT, e.g. ("--reference", "pkg.module:factory")

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ValueError(f"Entry {self.name}: level {self.level!r} not in {LEVELS}")
        # "": no plug-in option (the zoo itself); "--kernel-api=API" (argument "--kernel=SPEC"): a kernel with
        # FlashAttention's API API; "--kernel-api" (argument API): the zoo's own kernels of that API.
        if self.option not in ("--kernel", "--zoo", "--model", "", "--kernel-api", *_FLASH_OPTIONS):
            raise ValueError(f"Entry {self.name}: option {self.option!r}")
        if self.option in _FLASH_OPTIONS and not self.argument.startswith("--kernel="):
            raise ValueError(f"Entry {self.name}: {self.option} takes the argument '--kernel=SPEC'")
        if (self.level == "distributed") != ("--world-size" in self.extra):
            need = "needs" if self.level == "distributed" else "takes no"
            raise ValueError(f"Entry {self.name}: a {self.level} entry {need} --world-size W in its extra words")
        if self.level == "distributed" and self.option != "--kernel":
            raise ValueError(f"Entry {self.name}: a distributed entry is a context-parallel kernel (--kernel SPEC)")

    @property
    def needs_source_tree(self) -> bool:
        """An ``examples/file.py:factory`` path: only available in a checkout of the repository."""
        return self.option == "--model" and self.argument.split(":")[0].endswith(".py")

    @property
    def plug_in(self) -> list[str]:
        """The command-line words that plug the implementation in."""
        return ([self.option, self.argument] if self.option else []) + list(self.extra)

    @property
    def api(self) -> str:
        """The kernel's calling convention: sdpa, or the API of a ``--kernel-api=API`` entry (flash..., merge)."""
        return self.option.partition("=")[2] if self.option in _FLASH_OPTIONS else "sdpa"

    @property
    def spec(self) -> str:
        """The implementation's ``module:name`` (a kernel or factory spec) without the option words."""
        return self.argument.removeprefix("--kernel=")

    def resolved_argument(self, root: Path | None) -> str | None:
        """The argument with a relative ``.py`` path made absolute against ``root`` (None if absent)."""
        if not self.needs_source_tree:
            return self.argument
        path, _, name = self.argument.rpartition(":")
        if root is None or not (root / path).is_file():
            return None
        return f"{root / path}:{name}"


@dataclass(frozen=True)
class _Declared:
    entry: Entry
    module: str            # the module that declares it (its rank in properties.catalog's list orders the entries)
    order: int             # declaration order
    attribute: str = ""    # the module attribute the entry's argument names ("" for declare())
    kind: type | None = None   # a decorated class: the attribute must hold an instance of it


_DECLARED: list[_Declared] = []
_ORDER = itertools.count()


def _record(entry: Entry, module: str, attribute: str = "", kind: type | None = None) -> None:
    _DECLARED.append(_Declared(entry, module, next(_ORDER), attribute, kind))


def _where(obj, instance: str | None) -> tuple[str, str, type | None]:
    """(module, attribute, class or None) of a decorated function or class; a class needs ``instance``."""
    if isinstance(obj, type) and instance is None:
        raise TypeError(f"{obj.__qualname__}: a decorated class names the instance that is plugged in (instance=...)")
    return obj.__module__, instance or obj.__name__, obj if isinstance(obj, type) else None


def _plug_in(level: str, api: str, spec: str) -> tuple[str, str]:
    if level == "model":
        return "--model", spec
    if level == "distributed":   # a context-parallel kernel: --kernel SPEC, its --world-size (and --shard) in extra
        if api != "sdpa":
            raise ValueError(f"api {api!r}: a context-parallel kernel has the SDPA signature plus group=")
        return "--kernel", spec
    if api == "sdpa":
        return "--kernel", spec
    if api not in KERNEL_APIS:
        raise ValueError(f"api {api!r} not in sdpa, {', '.join(KERNEL_APIS)}")
    return f"--kernel-api={api}", f"--kernel={spec}"


def _family(api: str) -> str:
    """The word an entry's name carries for its API (``-k flash``, ``-k merge`` select them)."""
    return "merge" if api == "merge" else "flash"


def bug(*expected: str, mechanism: str, level: str = "kernel", api: str = "sdpa", instance: str | None = None,
        extra: tuple[str, ...] = ()) -> Callable[[T], T]:
    """Declare the decorated kernel (or, with ``level="model"``, model factory) broken: one of the clauses
    ``expected`` must catch it. A kernel of FlashAttention's API ``api`` is plugged in with ``--kernel-api=API``
    and its entry's name says flash (``-k flash`` selects them all); ``extra`` are further command-line words
    (``--deterministic``, ``--reference SPEC``; for ``level="distributed"``, a context-parallel kernel plugged in with
    ``--kernel``, its ``--world-size W`` and ``--shard LAYOUT``)."""
    if not expected:
        raise ValueError("a broken implementation names the clauses that must catch it")

    def declare_it(obj: T) -> T:
        module, attribute, kind = _where(obj, instance)
        name = attribute if api == "sdpa" or _family(api) in attribute else f"{_family(api)}_{attribute}"
        option, argument = _plug_in(level, api, f"{module}:{attribute}")
        _record(Entry(name, level, mechanism, tuple(expected), option, argument, tuple(extra)), module, attribute,
                kind)
        return obj
    return declare_it


def module_bug(name: str, overrides: str, *expected: str, mechanism: str) -> Callable[[T], T]:
    """Declare the decorated zoo part broken, plugged in with ``--zoo OVERRIDES``: ``{target}`` in ``overrides``
    stands for the class's ``_target_`` path (``module.Class``)."""
    if not expected:
        raise ValueError("a broken implementation names the clauses that must catch it")

    def declare_it(cls: T) -> T:
        target = f"{cls.__module__}.{cls.__qualname__}"
        _record(Entry(name, "module", mechanism, tuple(expected), "--zoo", overrides.format(target=target)),
                cls.__module__)
        return cls
    return declare_it


def correct(name: str, *, mechanism: str, level: str = "kernel", api: str = "sdpa", instance: str | None = None,
            zoo: str | None = None, extra: tuple[str, ...] = ()) -> Callable[[T], T]:
    """Declare the decorated kernel (model factory with ``level="model"``) correct: the suite must pass it with no
    failure. With ``zoo``, the entry is the zoo's model with the Hydra overrides ``zoo``, where ``{target}`` stands
    for the class's ``_target_`` path and ``{spec}`` for the function's ``module:name`` (level module)."""

    def declare_it(obj: T) -> T:
        if zoo is not None:
            spec, target = f"{obj.__module__}:{obj.__name__}", f"{obj.__module__}.{obj.__qualname__}"
            _record(Entry(name, "module", mechanism, (), "--zoo", zoo.format(target=target, spec=spec), tuple(extra)),
                    obj.__module__)
            return obj
        module, attribute, kind = _where(obj, instance)
        option, argument = _plug_in(level, api, f"{module}:{attribute}")
        _record(Entry(name, level, mechanism, (), option, argument, tuple(extra)), module, attribute, kind)
        return obj
    return declare_it


def declare(entry: Entry) -> Entry:
    """Record ``entry`` as it is: an implementation defined outside the catalog (PyTorch, the zoo, examples/)."""
    _record(entry, sys._getframe(1).f_globals.get("__name__", ""))
    return entry


def entries(modules: list[str]) -> tuple[list[Entry], list[Entry]]:
    """(broken, correct): the entries the imported ``modules`` declare, level by level (kernel, module, model), in
    the order of ``modules`` and, within one, of declaration (whatever imported them first). Raises ValueError for an
    entry declared in a module not listed, a name declared twice, or an entry whose module attribute is missing or
    is not the decorated class's instance."""
    rank = {module: index for index, module in enumerate(modules)}
    unlisted = sorted({d.module for d in _DECLARED if d.module not in rank})
    if unlisted:
        raise ValueError(f"modules that declare catalog entries but are not listed: {unlisted}")
    declared = sorted((d for d in _DECLARED if d.module in rank),
                      key=lambda d: (LEVELS.index(d.entry.level), rank[d.module], d.order))
    names = [d.entry.name for d in declared]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"catalog entries declared twice: {twice}")
    for d in declared:
        if not d.attribute:
            continue
        value = getattr(sys.modules[d.module], d.attribute, None)
        if value is None or (d.kind is not None and not isinstance(value, d.kind)):
            raise ValueError(f"catalog entry {d.entry.name}: {d.module}.{d.attribute} is not "
                             f"{'an instance of ' + d.kind.__qualname__ if d.kind else 'defined'}")
    return [d.entry for d in declared if d.entry.expected], [d.entry for d in declared if not d.entry.expected]
