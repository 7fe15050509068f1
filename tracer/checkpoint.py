"""Checkpoints as logical tensors (`init.checkpoint`, `checkpoint.save`): a directory whose tensors are
named by their logical (global, unsharded) names, the names the tracer uses. Every layout slices them
with its own layouts, exactly as it slices the consistent generator's weights (tracer/parameters.py).

Formats read (a local or shared-filesystem directory):
  ttrace       ttrace_checkpoint.json (index: step, seed, fingerprint, names, shapes, dtypes),
               model.safetensors (parameters), optimizer.safetensors (Adam: "<name>.exp_avg",
               "<name>.exp_avg_sq"; its step count is the index's "step")
  Hugging Face model.safetensors, or the shards of model.safetensors.index.json (weights only)
  torch DCP    torch.distributed.checkpoint's directory (.metadata): its tensor entries as weights,
               read in this process without a GPU. DCP's metadata is a pickle: read only checkpoints you
               trust (your own), as torch itself does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tracer.errors import ConfigError

INDEX = "ttrace_checkpoint.json"
WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
OPTIMIZER = "optimizer.safetensors"
DCP_METADATA = ".metadata"
FORMAT = "ttrace-checkpoint/1"
ADAM_STATE = ("exp_avg", "exp_avg_sq")
_SHOWN = 8   # names listed per kind of problem


@dataclass
class Checkpoint:
    """An opened checkpoint: what it holds (header only), tensors read on demand."""
    path: str
    kind: str                                   # ttrace | huggingface | dcp
    shapes: dict[str, tuple[int, ...]]          # parameter name -> logical shape
    files: dict[str, str]                       # tensor name -> safetensors file (optimizer state too)
    step: int = 0                               # optimizer steps taken before it was written
    optimizer: bool = False                     # holds Adam state for every parameter
    index: dict[str, Any] = field(default_factory=dict)
    _open: dict[str, Any] = field(default_factory=dict, repr=False)
    _dcp: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def tensor(self, name: str) -> torch.Tensor:
        """The full logical tensor `name` (a parameter, or "<param>.exp_avg" / ".exp_avg_sq")."""
        if self.kind == "dcp":
            return self._dcp_tensors()[name]
        file = self.files.get(name)
        if file is None:
            raise ConfigError(f"init.checkpoint={self.path} holds no tensor '{name}'")
        if file not in self._open:
            from safetensors import safe_open

            self._open[file] = safe_open(file, framework="pt")
        return self._open[file].get_tensor(name)

    def adam_state(self, name: str) -> dict[str, torch.Tensor]:
        return {k: self.tensor(f"{name}.{k}") for k in ADAM_STATE}

    def _dcp_tensors(self) -> dict[str, torch.Tensor]:
        if self._dcp is None:
            import torch.distributed.checkpoint as dcp

            dtypes = self.index["dtypes"]
            sd = {n: torch.empty(s, dtype=dtypes[n]) for n, s in self.shapes.items()}
            dcp.load(sd, storage_reader=dcp.FileSystemReader(self.path), no_dist=True)
            self._dcp = sd
        return self._dcp


def open_checkpoint(path: str) -> Checkpoint:
    """Open the checkpoint directory `path` (module doc), reading headers only."""
    from safetensors import SafetensorError

    where = f"init.checkpoint={path}"
    if not os.path.isdir(path):
        raise ConfigError(f"{where} is not a directory; give the directory checkpoint.save wrote, or a "
                          "Hugging Face or torch DCP checkpoint directory")
    try:
        if os.path.exists(os.path.join(path, INDEX)):
            return _open_ttrace(path)
        if os.path.exists(os.path.join(path, HF_INDEX)):
            with open(os.path.join(path, HF_INDEX)) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return _from_files(path, "huggingface", [os.path.join(path, s) for s in shards])
        if os.path.exists(os.path.join(path, WEIGHTS)):
            return _from_files(path, "huggingface", [os.path.join(path, WEIGHTS)])
        if os.path.exists(os.path.join(path, DCP_METADATA)):
            return _open_dcp(path)
    except (OSError, ValueError, KeyError, SafetensorError) as e:   # a truncated file, a malformed index
        raise ConfigError(f"{where} cannot be read ({type(e).__name__}: {e}); is it complete?") from None
    raise ConfigError(f"{where} holds none of {INDEX} (checkpoint.save), {WEIGHTS} or {HF_INDEX} (Hugging "
                      f"Face), {DCP_METADATA} (torch DCP)")


def _headers(files: Iterable[str]) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    from safetensors import safe_open

    shapes, where = {}, {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
                where[name] = file
    return shapes, where


def _from_files(path: str, kind: str, files: list[str]) -> Checkpoint:
    shapes, where = _headers(files)
    return Checkpoint(path, kind, shapes, where)


def _open_ttrace(path: str) -> Checkpoint:
    with open(os.path.join(path, INDEX)) as f:
        index = json.load(f)
    if index.get("format") != FORMAT:
        raise ValueError(f"{INDEX} has format {index.get('format')!r}, expected {FORMAT!r}")
    shapes, where = _headers([os.path.join(path, WEIGHTS)])
    optim = os.path.join(path, OPTIMIZER)
    has_optim = bool(index.get("optimizer")) and os.path.exists(optim)
    if has_optim:
        opt_shapes, opt_where = _headers([optim])
        where.update(opt_where)
        lacking = [f"{n}.{k}" for n in shapes for k in ADAM_STATE if opt_shapes.get(f"{n}.{k}") != shapes[n]]
        if lacking:
            raise ValueError(f"{OPTIMIZER} lacks (or misshapes) {', '.join(lacking[:_SHOWN])}")
    return Checkpoint(path, "ttrace", shapes, where, step=int(index.get("step", 0)), optimizer=has_optim,
                      index=index)


def _open_dcp(path: str) -> Checkpoint:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(path).read_metadata()
    tensors = {n: m for n, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    return Checkpoint(path, "dcp", {n: tuple(m.size) for n, m in tensors.items()}, {},
                      index={"dtypes": {n: m.properties.dtype for n, m in tensors.items()}})


def check_names(ckpt: Checkpoint, expected: Mapping[str, tuple[int, ...]], everything: set[str] | None,
                ignore: Iterable[str] = ()) -> list[str]:
    """What keeps `ckpt` from filling the parameters `expected` (global name -> logical shape): missing
    names, misshapen ones, and (when `everything`, every rank's names, is known) names no parameter
    takes. Buffers of the model (`ignore`) are not extra. Empty: it fits."""
    problems = []
    missing = sorted(n for n in expected if n not in ckpt.shapes)
    wrong = sorted(f"{n} {list(ckpt.shapes[n])} (model: {list(s)})" for n, s in expected.items()
                   if n in ckpt.shapes and tuple(ckpt.shapes[n]) != tuple(s))
    extra = sorted(set(ckpt.shapes) - everything - set(ignore)) if everything is not None else []
    for what, names in (("missing", missing), ("of the wrong shape", wrong), ("extra (no parameter "
                                                                             "takes them)", extra)):
        if names:
            more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
            problems.append(f"{len(names)} {what}: {', '.join(names[:_SHOWN])}{more}")
    return problems


def refuse(ckpt: Checkpoint, problems: list[str]) -> None:
    if problems:
        raise ConfigError(f"init.checkpoint={ckpt.path} ({ckpt.kind}) does not fit the model: "
                          f"{'; '.join(problems)}. A checkpoint's names are the model's logical parameter "
                          "names (those ttrace traces: `ttrace report` lists them); check model= matches "
                          "the model that wrote it")


def save_checkpoint(directory: str, params: Mapping[str, torch.Tensor],
                    adam: Mapping[str, Mapping[str, torch.Tensor]], meta: Mapping[str, Any]) -> None:
    """Write params and Adam state (exp_avg, exp_avg_sq per parameter) under their logical names, and
    the index last: a directory with an index is complete."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    index_path = os.path.join(directory, INDEX)
    if os.path.exists(index_path):
        os.remove(index_path)   # an old index must never describe the new files
    plain = lambda t: t.detach().cpu().contiguous()
    save_file({n: plain(t) for n, t in params.items()}, os.path.join(directory, WEIGHTS))
    state = {f"{n}.{k}": plain(s[k]) for n, s in adam.items() for k in ADAM_STATE}
    if state:
        save_file(state, os.path.join(directory, OPTIMIZER))
    index = {"format": FORMAT, **meta,
             "tensors": {n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                         for n, t in params.items()},
             "optimizer": {"kind": "adam", "state": list(ADAM_STATE)} if state else None}
    tmp = index_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(index, f, indent=1, default=str)
    os.replace(tmp, index_path)
