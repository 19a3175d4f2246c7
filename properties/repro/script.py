"""What every reproducer script holds, whatever it checks: the opening of its docstring, the loader of a plug-in, the
verdict, YAML as a Python literal, and the suite's own functions that it calls. Those are written from the source
of the function the suite runs (``source_of``), with the module-level constants they read: a script never runs a
copy kept in a template, which would drift from the code that decided the clause."""
from __future__ import annotations

import ast
import inspect
import textwrap

import torch

__all__ = ["intro", "LOAD", "VERDICT", "literal", "source_of"]

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


# The scripts' plug-in loader: the forms zoo/plugins.py (load_object) accepts, without the suite's watchdog.
LOAD = '''\
def load(spec):
    """'pkg.module:name', 'path/to/file.py:name', or (a kernel) one of the zoo's kernel names."""
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
