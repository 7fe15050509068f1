"""Trace parts written with O_DIRECT: from the slab to the device, around the page cache.

Written through the page cache, a part costs the writer thread the kernel's copy into newly allocated
cache pages: measured on the 2-core EPYC VM (ext4), 15 ms of CPU per 9 MB (a traced gpt_tiny step),
about half a step of the training it runs beside; the same bytes written with O_DIRECT cost 0.9 ms of
CPU (6.8 ms of wall time, waiting on the device, GIL released). A trace is written once and read
later, so keeping it out of the cache also leaves the training process's pages alone.

O_DIRECT wants the buffer's address, the file offset and the length aligned to the device's logical
block; ALIGN (4096) covers 512-byte and 4 KB devices. So a part is laid out for it:
  - its slab starts on an ALIGN boundary (`aligned_slab`);
  - the safetensors header (8-byte length, then JSON) is padded with spaces, as the format allows, to a
    multiple of ALIGN bytes, so the data that follows it starts on a boundary of the file too;
  - the data is the slab's bytes as they lie, rounded up to ALIGN, and the file is then truncated to
    its exact length.
Where the filesystem refuses O_DIRECT (tmpfs before Linux 6.6, some overlay and network filesystems:
EINVAL), the system has none (macOS), or the store is not a local directory, the writer falls back to
buffered writes (tracer/writer.py)."""

from __future__ import annotations

import errno
import mmap
import os
import struct
from typing import Any

import torch

ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)   # Linux and some BSDs; 0: none (buffered writes)


def aligned_slab(nbytes: int, pinned: bool = False, zero: bool = False) -> torch.Tensor:
    """A uint8 host buffer of `nbytes` starting on an ALIGN boundary, with room behind it up to the next
    boundary (`_blocks`): a view into a larger allocation (torch aligns host memory to 64 bytes only)."""
    alloc = torch.zeros if zero else torch.empty
    raw = alloc(_round_up(nbytes) + ALIGN, dtype=torch.uint8, pin_memory=pinned)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + nbytes]


def _blocks(slab: torch.Tensor, nbytes: int) -> Any:
    """The first `nbytes` of an aligned slab rounded up to whole blocks, as a numpy array (what an
    O_DIRECT write of them sends; the bytes past `nbytes` are cut off the file again)."""
    return slab.as_strided((_round_up(nbytes),), (1,), slab.storage_offset()).numpy()


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def header_block(header_json: bytes, align: int = ALIGN) -> bytes:
    """The safetensors header for data starting on an `align` boundary of the file: the 8-byte length
    and the JSON, padded with spaces to a multiple of `align` bytes in all (8: the format's own
    alignment, for parts written through the page cache)."""
    text = header_json + b" " * (-(len(header_json) + 8) % align)
    return struct.pack("<Q", len(text)) + text


# How a filesystem refuses O_DIRECT: EINVAL (tmpfs before Linux 6.6, overlay, some network
# filesystems), EOPNOTSUPP / ENOTSUP (some FUSE filesystems).
REFUSALS = frozenset({errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)})


def write_direct(path: str, head: bytes, slab: torch.Tensor, nbytes: int) -> bool:
    """Write `head` (a multiple of ALIGN bytes) then the first `nbytes` of `slab` (`aligned_slab`) to
    `path` with O_DIRECT, the file cut to its exact length. False, having written nothing that stays,
    where the system or the filesystem refuses O_DIRECT: the caller writes the part through the page
    cache instead."""
    if not _O_DIRECT:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o644)
    except OSError as e:
        if e.errno in REFUSALS:
            return False
        raise
    try:
        with mmap.mmap(-1, len(head)) as block:   # the header at an aligned (page) address
            block[:] = head
            _write_all(fd, memoryview(block), 0)
        _write_all(fd, memoryview(_blocks(slab, nbytes)), len(head))
        os.ftruncate(fd, len(head) + nbytes)
    except OSError as e:
        if e.errno not in REFUSALS:   # ENOSPC, EIO, ...: the store's own failure, the job's error
            raise
        os.unlink(path)   # opened, but this file's device wants another alignment
        return False
    finally:
        os.close(fd)
    return True


def _write_all(fd: int, buf: memoryview, offset: int) -> None:
    while buf:
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n

