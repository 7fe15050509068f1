"""Zero-copy reading of a safetensors buffer (a verified trace part, tracer/store.py): the tensors
as views into it, one typed view per run of same-dtype tensors."""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import torch

from tracer.errors import TraceError

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
              "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def safetensors_views(data: bytearray, path: str) -> dict[str, torch.Tensor]:
    """The tensors of a (checksum-verified) safetensors buffer as views into it: no copy.

    safetensors stores tensors back to back, grouped by dtype: each run of same-dtype tensors is
    one typed view of the buffer, split in one call (a view per tensor costs ~10x more)."""
    try:
        (n,) = struct.unpack_from("<Q", data)
        header = json.loads(bytes(data[8:8 + n]))
        header.pop("__metadata__", None)
        entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        out, run = {}, []
        for i, (key, h) in enumerate(entries):
            start, end = h["data_offsets"]
            dtype = _ST_DTYPES[h["dtype"]]
            if end > len(data) - 8 - n or end - start != math.prod(h["shape"]) * dtype.itemsize:
                raise ValueError(f"tensor '{key}' overruns the file or mismatches its shape")
            run.append((key, h, dtype))
            nxt = entries[i + 1][1] if i + 1 < len(entries) else None
            if nxt is None or nxt["dtype"] != h["dtype"] or nxt["data_offsets"][0] != end:
                out.update(_typed_run(data, 8 + n, run))
                run = []
        return out
    except (struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise TraceError(f"trace part {path} matches its checksum but is not a valid safetensors file "
                         f"({type(e).__name__}: {e}); it was not written by ttrace, rerun the job") from None


def _typed_run(data: bytearray, base: int, run: list[tuple[str, dict[str, Any], torch.dtype]]
               ) -> dict[str, torch.Tensor]:
    """Views of back-to-back tensors of one dtype."""
    dtype = run[0][2]
    begin = run[0][1]["data_offsets"][0]
    sizes = [math.prod(h["shape"]) for _, h, _ in run]
    total = sum(sizes)
    flat = (torch.frombuffer(data, dtype=dtype, count=total, offset=base + begin) if total
            else torch.empty(0, dtype=dtype))
    return {key: piece.view(h["shape"]) for (key, h, _), piece in zip(run, flat.split(sizes), strict=True)}
