"""``python -m properties [pytest options]``: the spec suite of the installed package, from any directory.

The same as ``pytest --pyargs properties [pytest options]``, e.g. ``python -m properties --kernel
mypkg.kernels:flash -q`` or ``python -m properties --model mypkg.models:make_model --report-json report.json``.
pytest runs in a child interpreter: this one has already imported the package, and pytest could no longer
rewrite its assertions.
"""
from __future__ import annotations

import subprocess
import sys


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    # -p names the plugin by its module name (the pytest11 entry point's name too): registered once, and present
    # even where plugin auto-loading is off (PYTEST_DISABLE_PLUGIN_AUTOLOAD).
    command = [sys.executable, "-m", "pytest", "-p", "properties.plugin", "--pyargs", "properties", *arguments]
    try:
        status = subprocess.call(command)
    except KeyboardInterrupt:
        return 130
    return 128 - status if status < 0 else status   # a child killed by signal N: 128 + N, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
