"""How much memory a device has free for new tensors, and where that figure comes from (the size check,
zoo/config/sizing.py, compares a model's needs with it)."""
from __future__ import annotations

import os
import resource

import torch

__all__ = ["available_memory"]


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read(64).strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def _host_memory() -> list[tuple[int, str]]:
    """The least of MemAvailable, the cgroup's limit minus its usage, and the address-space and data limits
    (ulimit -v, -d) minus what the process already maps."""
    found: list[tuple[int, str]] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError):
        pass
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < 2**60:
            found.append((max(limit - usage, 0), "the cgroup's memory limit"))
    for name, field, what in (("RLIMIT_AS", "VmSize", "ulimit -v"), ("RLIMIT_DATA", "VmData", "ulimit -d")):
        soft, _ = resource.getrlimit(getattr(resource, name))
        used = _status_bytes(field)
        if soft != resource.RLIM_INFINITY and used is not None:
            found.append((max(soft - used, 0), f"the process limit ({what})"))
    if not found:  # no /proc (macOS, BSD): the physical memory, an upper bound
        try:
            found.append((os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "the physical memory"))
        except (ValueError, OSError, AttributeError):
            pass
    return found


def available_memory(device) -> tuple[int, str] | None:
    """(bytes free for new tensors, where that figure comes from) on a device, or None when nothing says.

    CPU: the host's memory (``_host_memory``). CUDA and XPU: mem_get_info. MPS: the recommended working set minus
    what the driver holds. Any other device: the host's memory, which bounds what it can hold in practice."""
    device = torch.device(device)
    if device.type in ("cuda", "xpu") and hasattr(getattr(torch, device.type), "mem_get_info"):
        free, _ = getattr(torch, device.type).mem_get_info(device)
        return free, f"free on {device}"
    if device.type == "mps" and hasattr(torch, "mps") and hasattr(torch.mps, "recommended_max_memory"):
        free = torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory()
        return max(free, 0), "the MPS working set"
    found = _host_memory()
    if not found:
        return None
    free, where = min(found)
    return free, where if device.type == "cpu" else f"{where} of the host; {device} reports none of its own"
