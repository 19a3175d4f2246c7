"""What every reproducer script holds, whatever it checks: the opening of its docstring, the loader of a plug-in, the
verdict, YAML as a Python literal, and the suite's own functions that it calls. Those are written from the source
of the function the suite runs (``source_of``), with the module-level constants they read: a script never runs a
copy kept in a template, which would drift from the code that decided the clause."""
from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
import textwrap
from pathlib import Path

import torch

__all__ = ["intro", "prelude", "LOAD", "VERDICT", "literal", "source_of", "absolute_spec", "subject_roots"]

_INTRO = '''\
#!/usr/bin/env python3
"""Reproducer of {clause} ({title}), written by the spec suite's --repro-dir.

Clause: {statement}
Failing test: {nodeid}
Counterexample: {counterexample}'''


def intro(clause, nodeid: str, counterexample: str) -> str:
    """The first lines of a script: the clause (a properties.core.spec.Clause), the failing test, its counterexample."""
    return _INTRO.format(clause=clause.id, title=clause.title, nodeid=nodeid,
                         statement=textwrap.fill(clause.statement, 110, subsequent_indent="    "),
                         counterexample=counterexample or "(see the test's report)")


# Every script's exit status means one thing: 0 the departure is gone, 1 it is there (verdict), 2 the script could not
# check (its subject does not load, its data file moved, a bad argument, an error before any verdict). Python's own
# status for an uncaught exception is 1, the verdict's: the hook below turns it into 2.
_PRELUDE = '''\
SUBJECT_ROOTS = {roots!r}   # where the run imported the code under test from (searched after this directory)


def cannot_run(why):
    """Exit 2: nothing was checked (not a verdict on the subject)."""
    sys.stdout.flush()
    print(f"CANNOT RUN: {{why}}", file=sys.stderr)
    sys.exit(2)


def could_not_finish(kind, exc, tb):
    """An error before any verdict: shown, then exit 2, never Python's 1 (which means "the departure is there")."""
    import traceback
    sys.stdout.flush()
    traceback.print_exception(kind, exc, tb)
    print(f"CANNOT RUN: {{kind.__name__}}: {{exc}}", file=sys.stderr)
    sys.stderr.flush()
    os._exit(2)


sys.excepthook = could_not_finish
sys.path.extend(root for root in SUBJECT_ROOTS if root not in sys.path)
if len(sys.argv) > 2:
    cannot_run(f"one argument at most ({usage}), got {{len(sys.argv) - 1}}")
'''


def prelude(specs, usage: str) -> str:
    """The lines every script runs first: the exit statuses' meaning enforced, the directories its subjects were
    imported from, its command line checked (``usage``: what its one optional argument is)."""
    return _PRELUDE.format(roots=subject_roots(specs), usage=usage)


def absolute_spec(spec: str | None) -> str | None:
    """'path/file.py:name' with the path made absolute (against this process's directory, the run's), so that the
    script finds the file from any directory; any other spec as it is."""
    if not spec or ":" not in spec:
        return spec
    where, _, name = spec.rpartition(":")
    return f"{Path(where).resolve()}:{name}" if where.endswith(".py") else spec


def subject_roots(specs) -> list[str]:
    """For each 'pkg.module:name' spec, the directory on sys.path that holds pkg (as the run found it): a script run
    from elsewhere imports the module from there."""
    roots = []
    for spec in specs:
        if not spec or ":" not in spec or spec.rpartition(":")[0].endswith(".py"):
            continue
        where = spec.rpartition(":")[0]
        module = sys.modules.get(where)
        origin = getattr(module, "__file__", None)
        if origin is None:
            try:
                found = importlib.util.find_spec(where)
            except (ImportError, ValueError):
                continue
            origin = found.origin if found is not None else None
        if not origin or not origin.endswith(".py"):
            continue
        depth = where.count(".") + (1 if Path(origin).name == "__init__.py" else 0)
        root = str(Path(origin).resolve().parents[depth])
        if root not in roots:
            roots.append(root)
    return roots


# The scripts' plug-in loader: the forms zoo/runtime/plugins.py (load_object) accepts, without the suite's watchdog. A subject
# that does not load is exit 2 with one line, never a traceback that would read as the departure.
LOAD = '''\
def load(spec):
    """'pkg.module:name', 'path/to/file.py:name', or (a kernel) one of the zoo's kernel names."""
    try:
        if ":" not in spec:
            from zoo.nn.kernel import resolve_kernel
            return resolve_kernel(spec)
        module_name, _, name = spec.rpartition(":")
        if module_name.endswith(".py"):
            where = importlib.util.spec_from_file_location(pathlib.Path(module_name).stem, module_name)
            module = importlib.util.module_from_spec(where)
            sys.modules[where.name] = module
            where.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        for part in name.split("."):
            module = getattr(module, part)
        return module
    except Exception as exc:   # noqa: BLE001 -- whatever importing it raised
        cannot_run(f"the subject {spec!r} could not be loaded ({type(exc).__name__}: {exc}); give the code to "
                   f"check as this script's argument, in the form the suite's command line takes it")
'''

# The scripts' verdict, formatted with the clause's id.
VERDICT = '''\
def verdict(bad, message):
    """Print the departure in the clause's words and exit 1, or say it is gone and exit 0."""
    if bool(bad):
        print(f"FAIL {clause}: {{message}}")
        sys.exit(1)
    print(f"OK {clause}: no departure on this counterexample")
    sys.exit(0)
'''


def literal(text: str | None) -> str:
    """A YAML text as a readable triple-quoted Python literal (its repr where that would change it)."""
    if text is None or "\\" in text or '"""' in text:
        return repr(text)
    return '"""\\\n' + text + '"""'


def _constant(value) -> bool:
    """Whether a module-level value is written back exactly by its repr in a script that imports torch."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return True
    if isinstance(value, torch.dtype):
        return True   # repr: torch.float64
    return isinstance(value, tuple) and all(_constant(v) for v in value)


def source_of(*functions) -> str:
    """The source of each function as the suite defines it, preceded by the module-level constants it reads (in its
    body or its defaults), for a script to define and call. The other names it reads (torch, math) are the script's
    own imports."""
    constants, sources = {}, []
    for function in functions:
        text = textwrap.dedent(inspect.getsource(function))
        names = {node.id for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Name)}
        for name in sorted(names & set(function.__globals__)):
            if _constant(function.__globals__[name]):
                constants[name] = function.__globals__[name]
        sources.append(text)
    head = "".join(f"{name} = {value!r}\n" for name, value in constants.items())
    return ((head + "\n\n" if head else "") + "\n\n".join(sources)).rstrip("\n")
