"""A fresh pytest session per run, without a fresh interpreter per run.

The catalog runs the suite once per entry, as a user does (``python -m pytest properties/ --kernel ...`` in a new
directory), and most of such a short run used to be start-up: importing torch, Hypothesis, pytest, Hydra and
einops takes 2-3 s of the 3-6 s a caught entry costs. Here one server process imports them once and forks a
child per run; the child changes to the run's directory and calls ``pytest.main`` with the run's arguments,
with its output going to files, and exits with pytest's status. Each child is a new pytest session that
imports, collects and configures everything of the suite itself, in a process that no other run has touched:
the server imports only third-party libraries (the suite's own modules are imported by the child, so pytest
rewrites their asserts as in a plain run) and never runs any of them. What a forked child lacks compared with a
new interpreter is only the import time.

Some third-party packages are heavy and used by only some runs: Hugging Face's ``transformers`` (1 s of imports in
every run of a Hugging Face model) is imported by the server once a run of its own has imported it (``LEARNED``):
the child reports which of that package's modules it imported, and the server imports them before its next fork.
A server that never runs such a model never pays for it.

Where ``fork`` is unavailable (Windows) or the server cannot be started, a run is a subprocess as before:
:func:`run_pytest` has the same result either way. The server handles one run at a time; :class:`SessionPool`
keeps one server per concurrent caller.

    python -m properties.catalog.sessions   # the server; it reads requests on stdin (one JSON object per line)
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Session", "run_pytest", "SessionPool", "PRELOAD"]

# Third-party modules only (see the docstring); each is imported when present. torch._dynamo is imported on
# the first call of many torch functions (1.4 s), Hydra's compose by every level's collection (1 s).
PRELOAD = ("torch", "torch._dynamo", "numpy", "hypothesis", "hypothesis.extra.pytestplugin", "pytest",
           "_pytest.python", "_pytest.fixtures", "_pytest.assertion.rewrite", "_pytest.terminal", "pluggy", "einops",
           "omegaconf", "hydra", "hydra.compose", "hydra.initialize", "hydra._internal.hydra",
           "hydra._internal.config_loader_impl", "safetensors.torch", "yaml")
# Third-party packages the server imports once a run has imported them (see the docstring): the modules of these
# top-level packages that a run imported, nothing of the suite's own.
LEARNED = ("transformers",)
# pytest marks the packages of its plug-ins (Hypothesis', Hydra's) for assertion rewriting and warns that the
# server imported them already; a new interpreter would have rewritten nothing in them either (they hold no
# test code), so the warning is about the server, not the run, and the child does not print it.
PRELOAD_WARNING = ("-W", "ignore:Module already imported so cannot be rewritten:pytest.PytestAssertRewriteWarning")
# Servers of a pool that may die before its runs go on as subprocesses instead.
DEATHS = 3


@dataclass
class Session:
    """What a run left: pytest's exit status (None: killed at its time limit), its stdout and its stderr."""
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool = False

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def _subprocess_run(args, cwd, env, timeout) -> Session:
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=timeout)
        return Session(proc.returncode, proc.stdout, proc.stderr)
    except subprocess.TimeoutExpired as exc:
        def text(b):
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        return Session(None, text(exc.stdout), text(exc.stderr) + f"\ntimed out after {timeout:.0f} s", True)


class _Server:
    """One server process and its pipes; ``run`` sends a request and waits for the child's status."""

    def __init__(self, env: dict):
        self.env = env
        self.process = subprocess.Popen([sys.executable, "-m", "properties.catalog.sessions"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                                        cwd=tempfile.gettempdir())
        if self.process.stdout.readline().strip() != "ready":
            raise OSError("the pytest session server did not start")

    def run(self, args, cwd, env, timeout) -> Session:
        with tempfile.TemporaryDirectory(prefix="session-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            changes = {k: v for k, v in (env or {}).items() if self.env.get(k) != v}
            removed = [k for k in self.env if env is not None and k not in env]
            request = {"args": list(args), "cwd": str(cwd), "stdout": str(out), "stderr": str(err),
                       "env": changes, "unset": removed, "timeout": timeout}
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            reply = self.process.stdout.readline()
            if not reply:
                raise OSError("the pytest session server stopped")
            status = json.loads(reply)
            def read(p):
                return p.read_text(errors="replace") if p.exists() else ""
            stdout, stderr = read(out), read(err)
        if status["timed_out"]:
            stderr += f"\ntimed out after {timeout:.0f} s"
        return Session(status["returncode"], stdout, stderr, status["timed_out"])

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.close()
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()


class SessionPool:
    """Servers for callers that run sessions at the same time (threads). A server that dies (killed from outside: a
    program that ends its children) is replaced by a new one, and the run it died in is run again there; a server
    that cannot start, or ``DEATHS`` deaths, and the pool's runs are subprocesses for the rest of its life.

    A run whose environment differs from the pool's (beyond PYTHONPATH, which the child applies to its own path)
    gets a server started with that environment: the server's imports read it once (TRITON_INTERPRET, for one, is
    read when torch._dynamo imports Triton), and a child cannot change what they read."""

    def __init__(self, env: dict | None = None):
        self.env = dict(os.environ if env is None else env)
        self.idle: dict[tuple, queue.SimpleQueue[_Server]] = {}
        self.servers: list[_Server] = []
        self.lock = threading.Lock()
        self.broken = not hasattr(os, "fork")
        self.deaths = 0

    def _server_env(self, env: dict | None) -> tuple[tuple, dict]:
        if env is None:
            return (), self.env
        changes = tuple(sorted((k, v) for k, v in env.items() if k != "PYTHONPATH" and self.env.get(k) != v))
        removed = tuple(sorted(k for k in self.env if k != "PYTHONPATH" and k not in env))
        server_env = {k: v for k, v in {**self.env, **dict(changes)}.items() if k not in removed}
        return (changes, removed), server_env

    def run(self, args, cwd, env=None, timeout: float = 900) -> Session:
        key, server_env = self._server_env(env)
        with self.lock:
            idle = self.idle.setdefault(key, queue.SimpleQueue())
        while not self.broken:
            try:
                server = idle.get_nowait()
            except queue.Empty:
                try:
                    server = _Server(server_env)
                except OSError:
                    self.broken = True
                    break
                with self.lock:
                    self.servers.append(server)
            try:
                result = server.run(args, cwd, env, timeout)
            except (OSError, ValueError):  # the server died: the run again, on a new server
                server.close()
                with self.lock:
                    self.servers.remove(server)
                    self.deaths += 1
                    self.broken = self.broken or self.deaths >= DEATHS
                continue
            idle.put(server)
            return result
        return _subprocess_run(args, cwd, env, timeout)

    def close(self) -> None:
        with self.lock:
            for server in self.servers:
                server.close()
            self.servers.clear()


_POOL: SessionPool | None = None


def run_pytest(args, *, cwd, env: dict | None = None, timeout: float = 900) -> Session:
    """``python -m pytest ARGS`` in ``cwd`` with ``env`` (default: this process's), as a forked session of a
    server that imported torch once; the server is started on the first call (one per concurrent call) and
    ends with this process."""
    global _POOL
    if _POOL is None:
        import atexit
        _POOL = SessionPool({**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
        atexit.register(_POOL.close)
    return _POOL.run(args, cwd, {**_POOL.env, **(env or {})} if env is not None else None, timeout)


# ------------------------------------------------------------------------------------------------ the server
def _child(request: dict) -> None:
    """In the forked child: become ``python -m pytest ARGS`` run in the request's directory; never returns."""
    code = 70
    preloaded = set(sys.modules)
    try:
        os.setpgid(0, 0)   # its own group, so that a time-out ends whatever the session started too
        _die_with_parent()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)   # not the server's request pipe
        os.close(devnull)
        for name, path in (("stdout", 1), ("stderr", 2)):
            fd = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, path)
            os.close(fd)
        os.environ.update(request["env"])
        for name in request["unset"]:
            os.environ.pop(name, None)
        os.chdir(request["cwd"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.getcwd(), *extra, *sys.path[1:]]   # python -m puts the working directory first
        sys.argv = [sys.argv[0], *request["args"]]
        try:   # Hypothesis' example database lives in the working directory, as in a new process
            from hypothesis.configuration import set_hypothesis_home_dir
            set_hypothesis_home_dir(os.path.join(os.getcwd(), ".hypothesis"))
        except ImportError:
            pass
        _share_constants_cache()
        import pytest
        code = int(pytest.main([*request["args"], *PRELOAD_WARNING]))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:   # noqa: BLE001 -- reported on the session's stderr, as a crashed interpreter would
        import traceback
        traceback.print_exc()
        code = 1
    finally:
        try:
            _report_imports(request, preloaded)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _imports_path(request: dict) -> str:
    """Where a run reports its imports of the ``LEARNED`` packages: beside its stdout, in the caller's directory."""
    return os.path.join(os.path.dirname(request["stdout"]), "learned-imports.json")


def _report_imports(request: dict, preloaded: set[str]) -> None:
    learned = sorted(name for name in set(sys.modules) - preloaded if name.split(".")[0] in LEARNED)
    if learned:
        with open(_imports_path(request), "w") as file:
            json.dump(learned, file)


def _reported_imports(request: dict) -> list[str]:
    """The modules of the ``LEARNED`` packages a run imported that the server has not (read before the reply: the
    caller then removes its directory)."""
    try:
        with open(_imports_path(request)) as file:
            return [name for name in json.load(file) if name not in sys.modules]
    except (OSError, ValueError):
        return []


def _learn(names: list[str]) -> None:
    """In the server, after a run's reply: import ``names``, so that the next runs find them imported (their output,
    if any, goes to stderr: the server's stdout is its reply pipe)."""
    import contextlib
    import gc
    import importlib
    if not names:
        return
    with contextlib.redirect_stdout(sys.stderr):
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:   # noqa: BLE001 -- a run imports it as before
                pass
    gc.collect()
    gc.freeze()


# The server's cache of the constants Hypothesis reads out of the local modules' source (a directory; None: none).
_CONSTANTS: str | None = None


def _share_constants_cache() -> None:
    """A run in a new scratch directory (no ``.hypothesis`` there yet, under the temporary directory) reads the
    constants of every local module, parsing each module's source (1-2 s of each catalog run), and keeps them in
    ``.hypothesis/constants``, a cache keyed by a hash of each module's source: pointing it at the server's own
    cache changes nothing the run draws, only that the parse is done once per server. The example database
    (``.hypothesis/examples``) stays the run's own."""
    home = Path(os.getcwd()) / ".hypothesis"
    scratch = Path(tempfile.gettempdir()).resolve() in home.resolve().parents
    if _CONSTANTS is None or home.exists() or not scratch:
        return
    try:
        home.mkdir()
        (home / "constants").symlink_to(_CONSTANTS, target_is_directory=True)
    except OSError:
        pass


def _die_with_parent() -> None:
    """Linux: the child is killed if the server dies (a caller interrupted), instead of running on alone."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _wait(pid: int, timeout: float | None) -> tuple[int | None, bool]:
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.002
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        if deadline is not None and time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return None, True
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def serve() -> None:
    import importlib
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # What the server imported stays out of the children's garbage collections: each collection would otherwise walk
    # (and copy, page by page, out of the memory it shares with the server) torch's whole object graph.
    import gc
    gc.collect()
    gc.freeze()
    global _CONSTANTS
    _CONSTANTS = tempfile.mkdtemp(prefix="session-hypothesis-constants-")
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        returncode, timed_out = _wait(pid, request.get("timeout"))
        learned = _reported_imports(request)
        print(json.dumps({"returncode": returncode, "timed_out": timed_out}), flush=True)
        _learn(learned)
    import shutil
    shutil.rmtree(_CONSTANTS, ignore_errors=True)


if __name__ == "__main__":
    serve()
