"""Catalog of injectable silent bugs carried by this workload (names are the BUGS.md contract).

Each switch is off by default and is checked with `active(spec, name)` at the one place the real
code had the mistake; it changes numerics only (no crash, no hang).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Bug:
    name: str
    mechanism: str
    bugs_md: int        # entry number in BUGS.md
    needs: str          # parallelism that triggers it
    localize: str       # where a correct tool must point (module, tensor kind)


NONE = "none"

CATALOG: dict[str, Bug] = {b.name: b for b in (
    Bug("dp_grad_not_averaged",
        "data-parallel grads are all-reduced (summed) but never divided by the DP size",
        12, "dp>1", "every param_grad (x dp); first: embedding.word.weight. Adam hides it in loss/params"),
    Bug("sp_layernorm_grad_unreduced",
        "with TP+SP, LayerNorm weight/bias grads are not all-reduced over the TP group",
        1, "tp>1, sp", "layers.*.ln1/ln2 and final_ln weight/bias grads (param_grad; replicas disagree)"),
    Bug("row_parallel_bias_per_rank",
        "RowParallelLinear adds its bias to the partial output on every TP rank before the reduction",
        15, "tp>1", "layers.0.attn.proj output at step 1 (biases start at zero: step 0 is exact)"),
)}


def bug_name(spec: Mapping[str, Any]) -> str:
    return str((spec.get("bug") or {}).get("name", NONE) or NONE)


def active(spec: Mapping[str, Any], name: str) -> bool:
    """Is bug `name` switched on in this spec? (`name` must be in the catalog: typos fail loudly.)"""
    if name not in CATALOG:
        raise KeyError(f"unknown bug switch '{name}' queried in workload code; catalog: {sorted(CATALOG)}")
    return bug_name(spec) == name
