"""The safetensors format of trace parts: zero-copy reading of a buffer (a verified part,
tracer/store.py), the tensors as views into it, one typed view per run of same-dtype tensors; and
the header the writer (tracer/writer.py) puts before a part's bytes (`header_json`)."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from tracer.errors import TraceError

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
              "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


_ST_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}
_quote = json.encoder.encode_basestring_ascii   # a JSON string literal, as json.dumps writes one


class _ShapeJson(dict):
    """A shape's JSON array, formatted once per shape (shapes repeat every step)."""

    def __missing__(self, shape: tuple[int, ...]) -> str:
        text = self[shape] = f"[{','.join(map(str, shape))}]"
        return text


_SHAPES = _ShapeJson()


def header_json(entries: Iterable[tuple[str, torch.dtype, tuple[int, ...], int, int]]) -> bytes:
    """A part's safetensors header JSON from (name, dtype, shape, start, end) per tensor, in order:
    the text json.dumps makes of the format's nested dicts (byte for byte), formatted directly. The
    writer thread holds the GIL the training thread waits for while it runs: three containers per
    tensor and their encoding took 2.2-3.3 us a tensor (gpt_tiny's 398 a part), this 0.7."""
    return ("{" + ",".join([f'{_quote(name)}:{{"dtype":"{_ST_NAMES[dtype]}","shape":{_SHAPES[shape]},'
                            f'"data_offsets":[{start},{end}]}}'
                            for name, dtype, shape, start, end in entries]) + "}").encode()


class PartTensors(Mapping[str, torch.Tensor]):
    """A verified part's tensors, each viewed in the buffer when looked up (a view made per tensor
    up front cost a 16x comparison ~0.3 s for tensors it never looked up one by one), and runs of
    them viewed at once (`span`)."""

    def __init__(self, runs: list[torch.Tensor], where: dict[str, tuple[int, int, int, list[int]]]):
        self._runs = runs      # one flat typed view per run of back-to-back tensors of one dtype
        self._where = where    # key -> (run, first element, elements, shape)

    def __getitem__(self, key: str) -> torch.Tensor:
        run, at, n, shape = self._where[key]
        return self._runs[run][at:at + n].view(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def span(self, keys: Sequence[str]) -> torch.Tensor | None:
        """The tensors `keys`, in this order, as one flat view where they lie back to back in one run
        of one dtype; None otherwise."""
        run, at, n, _ = self._where[keys[0]]
        end = at + n
        for key in keys[1:]:
            r, a, m, _ = self._where[key]
            if r != run or a != end:
                return None
            end += m
        return self._runs[run][at:end]


def safetensors_views(data: Any, path: str) -> PartTensors:
    """The tensors of a (checksum-verified) safetensors buffer as views into it: no copy.

    safetensors stores tensors back to back, grouped by dtype: each run of same-dtype tensors is
    one typed view of the buffer, sliced per tensor when it is looked up."""
    try:
        (n,) = struct.unpack_from("<Q", data)
        header = json.loads(bytes(data[8:8 + n]))
        header.pop("__metadata__", None)
        entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        runs: list[torch.Tensor] = []
        where: dict[str, tuple[int, int, int, list[int]]] = {}
        run: list[tuple[str, dict[str, Any], torch.dtype]] = []
        for i, (key, h) in enumerate(entries):
            start, end = h["data_offsets"]
            dtype = _ST_DTYPES[h["dtype"]]
            if end > len(data) - 8 - n or end - start != math.prod(h["shape"]) * dtype.itemsize:
                raise ValueError(f"tensor '{key}' overruns the file or mismatches its shape")
            run.append((key, h, dtype))
            nxt = entries[i + 1][1] if i + 1 < len(entries) else None
            if nxt is None or nxt["dtype"] != h["dtype"] or nxt["data_offsets"][0] != end:
                runs.append(_typed_run(data, 8 + n, run, len(runs), where))
                run = []
        return PartTensors(runs, where)
    except (struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise TraceError(f"trace part {path} matches its checksum but is not a valid safetensors file "
                         f"({type(e).__name__}: {e}); it was not written by ttrace, rerun the job") from None


def _typed_run(data: Any, base: int, run: list[tuple[str, dict[str, Any], torch.dtype]], index: int,
               where: dict[str, tuple[int, int, int, list[int]]]) -> torch.Tensor:
    """One flat view of back-to-back tensors of one dtype; each one's place in it into `where`."""
    dtype = run[0][2]
    begin = run[0][1]["data_offsets"][0]
    at = 0
    for key, h, _ in run:
        n = math.prod(h["shape"])
        where[key] = (index, at, n, h["shape"])
        at += n
    return (torch.frombuffer(data, dtype=dtype, count=at, offset=base + begin) if at
            else torch.empty(0, dtype=dtype))
