"""The recipe's files: the checkpoint a check starts from (`init.checkpoint`), its token data
(`data.path`), and where the reference's final state goes (`checkpoint.save`). Their paths are taken
from the directory ttrace was started in, the inputs are checked before anything is scheduled, and
they enter the reference cache key by content (`identity`), never by name alone."""

from __future__ import annotations

import copy
import hashlib
import os
from functools import lru_cache
from typing import Any

from orchestrator import layouts
from tracer.errors import ConfigError

PATHS = (("init", "checkpoint"), ("checkpoint", "save"), ("data", "path"))
HASHED_BYTES = 256 << 20   # files up to this size are hashed; larger ones are known by size and mtime


def resolved(recipe: dict[str, Any], base_dir: str) -> dict[str, Any]:
    """The recipe with its input and output paths absolute (relative: from `base_dir`)."""
    out = copy.deepcopy(recipe)
    for section, key in PATHS:
        value = (out.get(section) or {}).get(key)
        if value in (None, ""):
            continue
        value = str(value)
        if "://" in value:
            raise ConfigError(f"{section}.{key}={value}: a local or shared-filesystem path (every rank reads "
                              "or writes it there), not a URL")
        out[section][key] = os.path.normpath(os.path.join(base_dir, os.path.expanduser(value)))
    return out


def identity(recipe: dict[str, Any]) -> dict[str, str | None]:
    """What the reference depends on in the input files: their content (module doc; `content_id`)."""
    out: dict[str, str | None] = {}
    for section, key in (("init", "checkpoint"), ("data", "path")):
        path = (recipe.get(section) or {}).get(key)
        out[f"{section}.{key}"] = content_id(os.path.abspath(str(path))) if path else None
    return out


def content_id(path: str) -> str:
    """A file's sha256 (up to HASHED_BYTES), else its size and mtime; a directory's from its files'.
    A changed file never reuses a cached reference; a copy of a large file is a cache miss."""
    if os.path.isdir(path):
        h = hashlib.sha256()
        for root, dirs, files in sorted(os.walk(path)):
            dirs.sort()
            for name in sorted(files):
                full = os.path.join(root, name)
                h.update(f"{os.path.relpath(full, path)}\0{content_id(full)}\0".encode())
        return h.hexdigest()[:20]
    if not os.path.exists(path):
        return "missing"
    st = os.stat(path)
    return _file_id(path, st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=256)
def _file_id(path: str, size: int, mtime_ns: int) -> str:
    if size > HASHED_BYTES:
        return f"size={size},mtime_ns={mtime_ns}"
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:20]


def validate(recipe: dict[str, Any], own_job: bool) -> None:
    """Check the input files of a (resolved) recipe: the token file whole (length, every id inside
    model.vocab for ttrace's own jobs, whose vocab the recipe sets), the checkpoint readable."""
    data = recipe.get("data") or {}
    if data.get("path"):
        from tracer.token_data import TokenFile

        model = recipe.get("model") or {}
        seq_len = int(model.get("seq_len", 1)) if own_job else 1
        TokenFile(str(data["path"]), str(data.get("dtype") or "uint16")).check(
            seq_len, int(model["vocab"]) if own_job else None)
    ckpt = (recipe.get("init") or {}).get("checkpoint")
    save = (recipe.get("checkpoint") or {}).get("save")
    if save and ckpt and os.path.abspath(str(save)) == os.path.abspath(str(ckpt)):
        raise ConfigError(f"checkpoint.save={save} is init.checkpoint: the reference would overwrite the "
                          "checkpoint every run starts from; save to another directory")
    ref = layouts.reference_layout(recipe) if save else None   # reference.parallel (issue 17, part 1)
    staged = int((ref or {}).get("pp") or 1) > 1
    unsaved = "pipeline stages" if staged else "a distributed optimizer (zero1)"
    if ref is not None and int(ref["world_size"]) > 1 and (staged or ref.get("zero1")):
        # The reference's ranks gather its parameters and Adam state to rank 0 (tracer/checkpoint_gather.py):
        # pipeline stages hold other parameters, a distributed optimizer's state is not parameter-shaped.
        raise ConfigError(f"checkpoint.save={save}: the reference runs on several ranks (reference.parallel="
                          f"{ref['name']}) with {unsaved}, "
                          "whose parameters and Adam state are not gathered for a checkpoint; save from a "
                          "reference without them (reference.parallel=single, tp2, dp2...), then start any "
                          "layout from it")
    if save and os.path.exists(str(save)) and not os.path.isdir(str(save)):
        raise ConfigError(f"checkpoint.save={save} exists and is not a directory")
    if ckpt:
        from tracer.checkpoint import open_checkpoint

        written_by = open_checkpoint(str(ckpt)).index.get("model")
        if own_job and written_by:
            _same_model(str(ckpt), written_by, recipe.get("model") or {})


# Model keys that change the parameters' names or shapes (the rest: attention implementation, aux loss).
SHAPING = ("arch", "vocab", "hidden", "heads", "layers", "seq_len", "ffn_hidden", "kv_heads",
           "tie_embeddings", "experts")


def _same_model(path: str, written_by: dict[str, Any], model: dict[str, Any]) -> None:
    """A checkpoint.save checkpoint records its model: a model of other shapes is refused here, before
    anything runs (the ranks would refuse its names)."""
    from dataclasses import asdict

    from orchestrator.schema import Model

    default = asdict(Model())
    was, now = ({k: m.get(k, default[k]) for k in SHAPING} for m in (written_by, model))
    differ = [f"{k}={was[k]} (here {now[k]})" for k in SHAPING if was[k] != now[k]]
    if differ:
        raise ConfigError(f"init.checkpoint={path} was written by model={written_by.get('name')} and this "
                          f"check runs model={model.get('name')}: {', '.join(differ)}; use "
                          f"model={written_by.get('name')} (or its sizes)")
