"""What the integrity, history and layout clauses share (SPEC.md, "Integrity, history and layouts"): snapshots of
the bytes behind the caller's tensors, storage overlap, and the comparison of two results of one problem.

A tensor is a view of a storage; what a caller owns is the whole storage (a sliced or transposed input's
neighbours are the caller's data too). Snapshots therefore copy every byte of each input's storage and compare
bitwise, as integers: a NaN payload or a -0.0 written over +0.0 counts as a change, which a float comparison
would miss.
"""
from __future__ import annotations

import torch
from hypothesis import settings

from properties.core.assertions import assert_identical, assert_within

__all__ = ["FEW", "StorageSnapshot", "snapshot", "assert_unchanged",
           "storage_span", "overlaps", "assert_no_alias", "assert_same_result", "as_integers", "bitwise_equal"]

# A sixth of the profile's draws (2 by default), after the pins: the FlashAttention-API integrity clauses fail on the
# first call that breaks them, whatever its shape, so a few draws cover them; the thorough profile scales them up with
# the rest. Read when the test modules import this one, at collection, after the plugin has loaded the profile.
FEW = settings(max_examples=max(2, settings().max_examples // 6))


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of ``t``'s storage, as a uint8 tensor on its device (a view, not a copy)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))


def as_integers(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements reinterpreted as integers of their width: equality of these is bitwise equality."""
    t = t.detach()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_integers(a), as_integers(b))


class StorageSnapshot:
    """A copy of the storage behind ``tensor`` and of its elements as seen through its view."""

    def __init__(self, name: str, tensor: torch.Tensor):
        self.name, self.tensor = name, tensor
        self.storage = _bytes(tensor).clone()
        self.elements = tensor.detach().clone()

    def check(self, when: str) -> None:
        """AssertionError naming the first changed element (or bytes outside the view) if anything changed."""
        __tracebackhide__ = True
        now = _bytes(self.tensor)
        if now.numel() == self.storage.numel() and torch.equal(now, self.storage):
            return
        seen = self.tensor.detach()
        if not bitwise_equal(seen, self.elements):
            changed = (as_integers(seen) != as_integers(self.elements)).nonzero()
            first = tuple(int(i) for i in changed[0]) if changed.numel() else ()
            before, after = self.elements[first].item(), seen[first].item()
            raise AssertionError(f"{self.name} changed {when}: {changed.shape[0]} of {seen.numel()} elements differ "
                                 f"bitwise, first at index {first}: {before!r} before, {after!r} after "
                                 f"(the caller's tensor, {str(seen.dtype).removeprefix('torch.')}"
                                 f"{tuple(seen.shape)}, strides {seen.stride()})")
        differ = int((now != self.storage).sum()) if now.numel() == self.storage.numel() else now.numel()
        raise AssertionError(f"{self.name}'s storage changed {when} outside the elements the view shows: {differ} "
                             f"of {self.storage.numel()} bytes differ (the view {tuple(seen.shape)}, strides "
                             f"{seen.stride()}, offset {seen.storage_offset()})")


def snapshot(tensors: dict) -> list[StorageSnapshot]:
    """Snapshots of the tensors among ``tensors`` (name -> tensor or anything else)."""
    return [StorageSnapshot(name, t) for name, t in tensors.items() if isinstance(t, torch.Tensor)]


def assert_unchanged(snapshots: list[StorageSnapshot], when: str) -> None:
    __tracebackhide__ = True
    for s in snapshots:
        s.check(when)


def storage_span(t: torch.Tensor) -> tuple[str, int, int]:
    """(device, first byte, one past the last byte) of the storage ``t`` lives in."""
    storage = t.untyped_storage()
    return str(t.device), storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the storages of ``a`` and ``b`` share a byte (a view of a common buffer counts)."""
    (da, a0, a1), (db, b0, b1) = storage_span(a), storage_span(b)
    return da == db and a0 < b1 and b0 < a1 and min(a1 - a0, b1 - b0) > 0


def assert_no_alias(out: torch.Tensor, inputs: dict, what: str = "the output") -> None:
    """``out``'s storage shares no byte with any tensor of ``inputs`` (name -> tensor or anything else)."""
    __tracebackhide__ = True
    for name, t in inputs.items():
        if isinstance(t, torch.Tensor) and overlaps(out, t):
            raise AssertionError(f"{what} shares storage with {name} ({str(out.device)} bytes "
                                 f"[{storage_span(out)[1]:#x}, {storage_span(out)[2]:#x}) and "
                                 f"[{storage_span(t)[1]:#x}, {storage_span(t)[2]:#x})): writing into one changes "
                                 f"the other")


def assert_same_result(actual: torch.Tensor, expected: torch.Tensor, repeats_bitwise: bool, bound, *, what: str,
                       reference: str, note: str = "") -> None:
    """Two results of one problem: bitwise equal (NaN where NaN) when the kernel repeats bitwise, else within
    ``bound`` (SPEC.md, ATTN-HISTORY: a kernel that does not repeat itself is held to twice the oracle bound)."""
    __tracebackhide__ = True
    if repeats_bitwise:
        assert_identical(actual, expected, what=what, reference=reference,
                         note=f"{note} (the kernel repeats this problem bitwise)")
    else:
        assert_within(actual, expected, bound, what=what, reference=reference,
                      note=f"{note} (the kernel does not repeat this problem bitwise: twice the oracle bound)")
