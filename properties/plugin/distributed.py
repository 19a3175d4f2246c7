"""The distributed level's part of the plug-in (--world-size, --shard, --master-port): its options checked, the ranks
started once for the run (properties/distributed/world.py), the kernels probed, the ``cp_kernel`` fixture, and the
ranks stopped at the end. properties/plugin/suite.py registers it and calls ``configure`` last.

Under torchrun (RANK and WORLD_SIZE set) every rank runs pytest with the same options: rank 0 runs the session and
draws, the others serve it from ``configure`` until it ends, then run no test.
"""
from __future__ import annotations

import os

import pytest

from properties.core.dtypes import selected_dtypes
from properties.core.watchdog import limit
from properties.distributed.guard import ContextParallelKernel, GroupContract
from properties.kernel.guard import KernelDeclined
from properties.plugin._utils import number_option
from properties.distributed.world import SpawnedWorld, WorldError, start_torchrun_rank, under_torchrun

__all__ = ["configure", "world_size", "max_ranks", "refuse_without_world_size", "kernel_params", "world_of",
           "KERNEL_PARAMS"]

KERNEL_PARAMS = pytest.StashKey[list]()
_WORLD = pytest.StashKey[object]()
_SERVED = pytest.StashKey[bool]()
RANK_MEMORY = 400 * 2 ** 20   # bytes a CPU rank needs: a Python process with torch imported, and its shards


def world_size(config) -> int | None:
    """--world-size as a number (None when not given); a UsageError for anything but a whole number >= 1."""
    return number_option(config, "--world-size", _whole_number, lambda size: size >= 1,
                         "a whole number of ranks, at least 1")


def _whole_number(text: str) -> int:
    """int(text) for digits as a person writes them (no sign, no leading zeros); else ValueError."""
    number = int(text)
    if str(number) != str(text).strip():
        raise ValueError(text)
    return number


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def max_ranks(device: str) -> tuple[int, str]:
    """(the most ranks this machine can hold on ``device``, why): a GPU each on CUDA; on the CPU four per core (a
    collective waits for every rank to be scheduled: beyond that the run only waits) and RANK_MEMORY each."""
    if device != "cpu":
        import torch
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return count, f"{count} GPU{'s' if count != 1 else ''} visible (one rank per GPU)"
    cores = os.cpu_count() or 1
    most, why = 4 * cores, f"{cores} CPU core{'s' if cores != 1 else ''} (at most 4 ranks per core)"
    memory = _available_memory()
    if memory is not None and memory // RANK_MEMORY < most:
        most, why = max(1, memory // RANK_MEMORY), f"{memory / 2 ** 30:.1f} GiB of available memory " \
                                                   f"({RANK_MEMORY // 2 ** 20} MiB per rank)"
    return most, why


def _port(config) -> int | None:
    return number_option(config, "--master-port", int, lambda port: 1 <= port <= 65535,
                         "a TCP port number, 1 to 65535")


def refuse_without_world_size(config) -> None:
    """--shard and --master-port shape the distributed level only."""
    if world_size(config) is not None:
        return
    given = [name for name, default in (("--shard", "contiguous"), ("--master-port", None))
             if config.getoption(name, default) != default]
    if given:
        raise pytest.UsageError(f"{', '.join(given)}: the distributed level's option{'s' if len(given) > 1 else ''}, "
                                f"but no --world-size W is given")


def _device(config) -> str:
    devices = config.getoption("--device") or ["cpu"]
    if len(devices) > 1:
        raise pytest.UsageError(f"--world-size: one --device at a time (the ranks run on one kind of device); "
                                f"got {', '.join(devices)}")
    device = devices[0]
    if device not in ("cpu", "cuda"):
        raise pytest.UsageError(f"--world-size with --device {device}: expected cpu (gloo) or cuda (NCCL, one GPU "
                                f"per rank)")
    return device


def configure(config) -> None:
    """With --world-size: check it, start (or join) the ranks, load and probe the kernels."""
    refuse_without_world_size(config)
    size = world_size(config)
    if size is None:
        return
    for option, default in (("--kernel-api", "sdpa"), ("--model", None), ("--zoo", None), ("--zoo-config", None),
                            ("--returns-lse", False), ("--reference-kernel", None)):
        if config.getoption(option, default) not in (default, None, False):
            raise pytest.UsageError(f"--world-size checks context-parallel kernels (kernel(q, k, v, is_causal=, "
                                    f"scale=, enable_gqa=, group=) on each rank's shard); {option} does not apply "
                                    f"to them: run it without --world-size")
    device = _device(config)
    layout = config.getoption("--shard")
    port = _port(config)
    from zoo.nn.context_parallel import CONTEXT_PARALLEL
    specs = config.getoption("--kernel") or list(CONTEXT_PARALLEL[layout])
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != size:
            raise pytest.UsageError(f"--world-size {size}, but torchrun started {os.environ['WORLD_SIZE']} "
                                    f"processes (WORLD_SIZE): give the same number")
        world = start_torchrun_rank(device=device, limit=limit(), specs=specs, layout=layout)
        if world is None:   # this rank served rank 0's session, which has ended
            config.stash[_SERVED] = True
            config.stash[KERNEL_PARAMS] = []
            return
    else:
        most, why = max_ranks(device)
        if size > most:
            raise pytest.UsageError(f"--world-size {size}: this machine holds at most {most} rank"
                                    f"{'s' if most != 1 else ''} on {device}: {why}")
        world = SpawnedWorld(size, device=device, limit=limit(), specs=specs, layout=layout, port=port)
        try:
            world.start()
        except WorldError as exc:
            raise pytest.UsageError(f"--world-size {size}: {exc}") from None
    config.stash[_WORLD] = world
    for spec, (kind, error) in world.load_errors.items():
        world.stop()
        raise pytest.UsageError(f"--kernel: {error}" if kind == "plugin" else f"--kernel {spec}: {error}" if
                                kind != "group" else f"--kernel {spec}: {error} (while importing it)")
    kernels = [ContextParallelKernel(spec, layout, world, size) for spec in specs]
    for kernel in kernels:
        try:
            kernel.probe(selected_dtypes())
        except GroupContract as exc:
            world.stop()
            raise pytest.UsageError(f"--{str(exc).split(' [clause')[0]}") from None
        except KernelDeclined as exc:
            world.stop()
            raise pytest.UsageError(f"--kernel {kernel.name} --shard {layout}: {exc}: nothing to verify (is it "
                                    f"written for the other --shard layout, or for another --dtype?)") from None
    config.stash[KERNEL_PARAMS] = [pytest.param(k, id=k.name) for k in kernels]


def kernel_params(config) -> list:
    """The ``cp_kernel`` parametrization: the kernels of --world-size, or one entry skipped with the reason."""
    if KERNEL_PARAMS in config.stash:
        return config.stash[KERNEL_PARAMS]
    return [pytest.param(None, id="no-world-size", marks=pytest.mark.skip(
        reason="the distributed clauses run with --world-size W (a context-parallel kernel on W ranks)"))]


def pytest_generate_tests(metafunc):
    if "cp_kernel" in metafunc.fixturenames:
        params = kernel_params(metafunc.config)
        metafunc.parametrize("cp_kernel", params, scope="session")


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """A torchrun rank other than 0 has served rank 0's session: it runs no test of its own."""
    if session.config.stash.get(_SERVED, False):
        return True
    return None


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if config.stash.get(_SERVED, False):
        terminalreporter.write_line(f"torchrun rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: served rank 0's "
                                    f"session (the results above are rank 0's)")


def pytest_unconfigure(config):
    world = config.stash.get(_WORLD, None)
    if world is not None:
        world.stop()
        del config.stash[_WORLD]


def world_of(config):
    """The ranks of this run (None without --world-size)."""
    return config.stash.get(_WORLD, None)
