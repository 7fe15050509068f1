"""Snapshots of traced tensors into pooled host buffers: all the training thread does per tensor.

A *part* is one future safetensors file: a host byte buffer (a *slab*, taken from a pool and given
back once the part is written) into which each recorded tensor is copied at the next offset aligned
to its element size. Nothing is allocated per tensor and nothing is serialized here: the writer
thread (tracer/writer.py) turns a full part into a file from the slab's bytes as they lie.

CUDA tensors are copied with `non_blocking=True` into a pinned slab on a side stream that first
waits for the producing stream; the producing stream then waits for the copy (an event), so an
in-place update after the record (gradient clipping, the optimizer) cannot race it, and the CPU
thread never waits. The part's events are recorded at `fence`; the writer thread synchronizes on
them before it reads the slab, and the source tensors are held until then. This path is used only
when `torch.cuda.is_available()`; its ordering logic is unit-tested on CPU with a stand-in for
torch.cuda (tests/tracer/test_writer.py) and it is UNTESTED ON A GPU until a GPU run exists.
"""

from __future__ import annotations

import collections
import ctypes
from typing import Any, NamedTuple

import torch

from tracer.direct_io import aligned_slab


class Slot(NamedTuple):
    """One snapshot in a part (its fields laid flat in Part.cells on the hot path, in this order)."""

    row: int                  # the writer's record index (its manifest entry)
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int               # byte offset in the slab
    nbytes: int
    keep: bool                # written to the part file (False: its statistics only, tracer/stats.py)


SLOT_CELLS = len(Slot._fields)


def slot_columns(cells: list[Any]) -> list[list[Any]]:
    """Slot fields laid flat (SLOT_CELLS a slot, Part.cells) as one list per field."""
    return [cells[i::SLOT_CELLS] for i in range(SLOT_CELLS)]


def slot_tuples(cells: list[Any]) -> list[tuple]:
    """Slot fields laid flat as one tuple per slot, in order."""
    return list(zip(*slot_columns(cells), strict=True))


class Part:
    """A slab being filled, then written (module doc)."""

    def __init__(self, slab: torch.Tensor):
        self.slab = slab                  # uint8, host (pinned for CUDA sources)
        self.capacity = slab.numel()
        self.base = slab.data_ptr()       # host address of byte 0 (the memmove path of `snapshot`)
        self.used = 0
        # Slot fields, SLOT_CELLS per snapshot, flat: a tuple per snapshot would be a survivor the
        # cyclic GC tracks (tracer/writer.py says what those cost); `slots` makes the tuples, on the
        # writer thread
        self.cells: list[Any] = []
        self.holds: list[torch.Tensor] = []   # device sources until `events` fire
        self.events: list[Any] = []
        # dtype -> (the slab viewed as dtype, the storage offset of the slab's byte 0 in its elements:
        # an aligned slab is a view into a larger allocation, and as_strided counts from the storage)
        self.typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}

    def slots(self) -> list[tuple]:
        """Each snapshot's Slot fields, in slab order."""
        return slot_tuples(self.cells)

    def typed_view(self, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        size = dtype.itemsize
        view = self.slab[:self.capacity // size * size].view(dtype)
        self.typed[dtype] = view, view.storage_offset()
        return self.typed[dtype]


class SlabPool:
    """Host buffers of `size` bytes, reused part after part (a larger tensor gets a one-off slab), each
    starting on a block boundary (tracer/direct_io.py). Taken on the training thread, given back on the
    writer thread (deque operations are atomic)."""

    def __init__(self, size: int, keep: int):
        self.size, self.keep = size, keep
        self._free: collections.deque[torch.Tensor] = collections.deque()

    def take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        if nbytes <= self.size:
            try:
                return self._free.pop()
            except IndexError:
                pass
        return aligned_slab(max(nbytes, self.size), pinned)

    def warm(self, count: int, pinned: bool = False) -> None:
        """Writer thread, at start: `count` slabs allocated and touched (page faults taken here, off the
        training thread: measured, a fresh 32 MB slab's first step cost the training thread ~90 ms)."""
        for _ in range(count - len(self._free)):
            self._free.append(aligned_slab(self.size, pinned, zero=True))

    def give(self, slab: torch.Tensor) -> None:
        if slab.numel() == self.size and len(self._free) < self.keep:
            self._free.append(slab)


class DeviceCopier:
    """Device-to-host copies on a side stream, ordered by events (module doc). `cuda` is torch.cuda;
    tests pass a stand-in with the same calls."""

    def __init__(self, cuda: Any = None):
        self.cuda = torch.cuda if cuda is None else cuda
        self._streams: dict[Any, Any] = {}

    def copy(self, part: Part, dst: torch.Tensor, src: torch.Tensor) -> None:
        side = self._stream(src.device)
        compute = self.cuda.current_stream(src.device)
        side.wait_stream(compute)            # the copy reads src after the kernels that produced it
        with self.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            done = self.cuda.Event()
            done.record(side)
        compute.wait_event(done)             # later in-place updates of src wait for the copy
        part.holds.append(src)               # src outlives the copy: released by the writer thread

    def fence(self, part: Part) -> None:
        """Mark the end of the part's copies: the writer thread waits on these events."""
        for device in {t.device for t in part.holds}:
            event = self.cuda.Event()
            event.record(self._stream(device))
            part.events.append(event)

    def _stream(self, device: Any) -> Any:
        if device not in self._streams:
            self._streams[device] = self.cuda.Stream(device=device)
        return self._streams[device]


def wait_for_copies(part: Part) -> None:
    """Writer thread: block until the part's device copies landed, then release their sources."""
    for event in part.events:
        event.synchronize()
    part.events.clear()
    part.holds.clear()


# libc's memmove called WITHOUT releasing the GIL (a PyDLL function): ctypes.memmove releases it, and
# each release hands the GIL to the writer thread for up to the switch interval (5 ms).
_memmove = ctypes.PyDLL(None).memmove
_memmove.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memmove.restype = ctypes.c_void_p

_OWN_BYTES = (torch.Tensor, torch.nn.Parameter)   # types whose values lie at data_ptr() (not a subclass
                                                   # wrapping others, as DTensor does)
_STRIDES: dict[tuple[int, ...], tuple[int, ...]] = {}   # contiguous strides per shape (shapes repeat)
_COMPLEX = frozenset((torch.complex32, torch.complex64, torch.complex128))


# Shapes as the writer keeps them: one tuple per distinct shape (a record's cells hold no tuple of its
# own, tracer/writer.py), looked up by the tensor's torch.Size (which hashes and compares as a tuple).
INTERNED: dict[tuple[int, ...], tuple[int, ...]] = {}
_INTERN_MAX = 1 << 16   # distinct shapes kept (e.g. varying sequence lengths); beyond, a tuple per record


def interned(size: tuple[int, ...]) -> tuple[int, ...]:
    """`size` as a tuple, the one kept for its shape (INTERNED.get(size) first: the hot path)."""
    shape = tuple(size)
    if len(INTERNED) < _INTERN_MAX:
        INTERNED[shape] = shape
    return shape


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, n = [], 1
    for d in reversed(shape):
        out.append(n)
        n *= d
    strides = _STRIDES[shape] = tuple(reversed(out))
    return strides


def snapshot(part: Part, row: int, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...],
             copier: DeviceCopier | None, keep: bool = True) -> bool:
    """Copy `tensor`'s values (its `dtype` and `shape`, which the caller has read once for both the
    snapshot and its record) into the part at the next offset aligned to its element size; False if
    it does not fit (the caller starts a new part). The training thread's hot path, no allocation: a
    dense host tensor is one memmove of its bytes, any other tensor two torch calls (a view of the
    slab, the copy). Every torch call here costs 60-120 ns, about twice that amid a training step."""
    size = dtype.itemsize
    nbytes = tensor.nbytes
    off = -(-part.used // size) * size
    if off + nbytes > part.capacity:
        return False
    if (nbytes and type(tensor) in _OWN_BYTES and tensor.is_cpu and tensor.is_contiguous()
            and not tensor.is_neg() and (dtype not in _COMPLEX or not tensor.is_conj())):
        # The per-call cost of `as_strided` + `copy_` dominates for the ~25 KB tensors a small model
        # traces: gpt_tiny's snapshots took 9 ms of a step that way, 5 ms as memmoves. Plain tensors
        # only: a subclass (DTensor) has no bytes of its own at data_ptr(); lazy negation or
        # conjugation (complex dtypes only: torch sets the conjugate bit on nothing else), no bytes
        # that are its values. A Parameter is a plain tensor with its own bytes.
        _memmove(part.base + off, tensor.data_ptr(), nbytes)
    elif nbytes:
        tensor = tensor.detach()   # the copy is not part of the graph (a memmove never is)
        typed, first = part.typed.get(dtype) or part.typed_view(dtype)
        dst = typed.as_strided(shape, _STRIDES.get(shape) or _strides(shape), first + off // size)
        if copier is None or not tensor.is_cuda:
            dst.copy_(tensor)
        else:
            copier.copy(part, dst, tensor)
    part.cells += (row, dtype, shape, off, nbytes, keep)   # a temporary tuple: no GC survivor
    part.used = off + nbytes
    return True
