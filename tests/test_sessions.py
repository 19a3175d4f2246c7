"""The catalog's pytest session server (properties/catalog/sessions.py): a run is a fresh pytest session forked from a
server that imported the heavy third-party libraries once; a package in ``LEARNED`` is imported by the server only
after one of its runs has imported it, and the next runs find it imported."""
from __future__ import annotations

import pytest

from properties.catalog.sessions import LEARNED, SessionPool

CHECK = """import sys

IMPORTED_BEFORE = {package!r} in sys.modules
import {package}


def test_{name}():
    assert IMPORTED_BEFORE is {expected}
"""


@pytest.mark.parametrize("package", LEARNED)
def test_a_server_imports_a_learned_package_once_a_run_used_it(tmp_path, package):
    pytest.importorskip(package)
    pool = SessionPool()
    try:
        for name, expected in (("first", False), ("second", True)):
            (tmp_path / f"test_{name}.py").write_text(CHECK.format(package=package, name=name, expected=expected))
            result = pool.run([str(tmp_path / f"test_{name}.py"), "-q", "-p", "no:cacheprovider"], cwd=tmp_path)
            if pool.broken:
                pytest.skip("this platform has no fork: every run is a new interpreter")
            assert result.returncode == 0, result.output[-3000:]
    finally:
        pool.close()


def test_a_server_killed_from_outside_is_replaced(tmp_path):
    """A program that ends its children (`python -m zoo` as a command does) kills the servers of the pool of the process
    it runs in: the run that meets the dead server runs again on a new one, and so do the next ones."""
    (tmp_path / "test_pid.py").write_text("import os\n\n\ndef test_pid():\n    print('parent', os.getppid())\n")
    pool = SessionPool()
    try:
        def parent() -> int:
            result = pool.run([str(tmp_path / "test_pid.py"), "-q", "-s", "-p", "no:cacheprovider"], cwd=tmp_path)
            assert result.returncode == 0, result.output[-3000:]
            return int(result.stdout.split("parent ")[1].split()[0])
        first = parent()
        if pool.broken:
            pytest.skip("this platform has no fork: every run is a new interpreter")
        [server] = pool.servers
        assert first == server.process.pid   # forked from the server
        server.process.kill()
        server.process.wait()
        [second] = {parent(), parent()}
        assert second == pool.servers[0].process.pid != first and len(pool.servers) == 1 and not pool.broken
    finally:
        pool.close()
