"""Tracing plans: module-name patterns -> how that module's output and parameters are laid out.

A plan reads like torchtitan's parallelize plan: {"layers.*.attn.qkv": ModuleLayout(...)}. `*` matches
one path component. Listed modules are traced; unlisted parameters are replicated.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache

from torch import nn

from tracer.layouts import Layout, Replicate


@dataclass(frozen=True)
class ModuleLayout:
    output: Layout = field(default_factory=Replicate)
    params: Mapping[str, Layout] = field(default_factory=dict)  # relative param name -> layout
    trace: bool = True  # trace the output and its gradient
    # Layout of the output's gradient when it differs from the output's: a replicated output used by
    # TP-parallel consumers (e.g. a KV head shared by several TP ranks) has a partial-sum gradient.
    grad: Layout | None = None

    @property
    def grad_layout(self) -> Layout:
        return self.output if self.grad is None else self.grad


Plan = Mapping[str, ModuleLayout]
Rename = Callable[[str], str]

# The attributes torch's module wrappers hold the wrapped module under: activation checkpointing's
# checkpoint_wrapper (torchtitan's AC), torch.compile's OptimizedModule, FSDP1. They are no part of a
# logical name: a wrapped model names its modules and parameters as it does unwrapped (a reference
# runs it unwrapped), as their own state_dict hooks do.
WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
_WRAPPER = re.compile(r"(?:^|\.)(?:" + "|".join(WRAPPERS) + r")(?=\.|$)")


# DistributedDataParallel and DataParallel hold the model under `module`, and only as the root: a
# leading `module.` is theirs (a submodule of that name deeper down is the model's own). A model whose
# own top-level child is named `module` is named alike in every run, reference included.
_ROOT_WRAPPER = "module"


def unwrapped(name: str) -> str:
    """`name` without torch's wrapper attributes (WRAPPERS; a DDP root's `module`):
    'layers.0._checkpoint_wrapped_module.wq' is 'layers.0.wq', 'module.layers.0.wq' too."""
    if name.startswith(_ROOT_WRAPPER) and name[len(_ROOT_WRAPPER):len(_ROOT_WRAPPER) + 1] in ("", "."):
        name = name[len(_ROOT_WRAPPER) + 1:]
    return _WRAPPER.sub("", name).lstrip(".") if _WRAPPER.search(name) else name


def is_root_wrapper(module: nn.Module) -> bool:
    """A DistributedDataParallel or DataParallel wrapper: the model it holds is traced, not it."""
    return isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel))


def logical_names(rename: Rename | None) -> Rename:
    """A name's logical form: unwrapped, then `rename`d (pipeline stages: local to global layers)."""
    if rename is None:
        return unwrapped
    return lambda name: rename(unwrapped(name))


@lru_cache(maxsize=1024)
def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile("".join("[^.]+" if part == "*" else re.escape(part)
                              for part in re.split(r"(\*)", pattern)) + r"\Z")


def match(plan: Plan, name: str) -> ModuleLayout | None:
    """The plan entry for a module name (first matching pattern), or None."""
    for pattern, layout in plan.items():
        if _regex(pattern).match(name):
            return layout
    return None


def traced_modules(model: nn.Module, plan: Plan) -> Iterator[tuple[str, nn.Module, ModuleLayout]]:
    for name, module in model.named_modules():
        entry = None if is_root_wrapper(module) else match(plan, unwrapped(name))
        if entry is not None:
            yield name, module, entry


def param_layouts(model: nn.Module, plan: Plan) -> dict[str, Layout]:
    """Layout of every parameter of `model` (replicated unless a plan entry says otherwise)."""
    layouts = {name: Replicate() for name, _ in model.named_parameters()}
    for mname, _, entry in traced_modules(model, plan):
        for rel, layout in entry.params.items():
            full = f"{mname}.{rel}" if mname else rel
            if full not in layouts:
                raise KeyError(f"plan entry for '{mname}' names parameter '{rel}', which the module lacks")
            layouts[full] = layout
    return layouts


@dataclass(frozen=True)
class PipelineRenaming:
    """Rename a stage's local layer numbers to global ones (PP: layers.0 on stage 1 is layers.N/2)."""

    offset: int
    pattern: str = r"^layers\.(\d+)"

    def __call__(self, name: str) -> str:
        return re.sub(self.pattern, lambda m: m.group(0)[: m.start(1) - m.start(0)]
                      + str(int(m.group(1)) + self.offset), name, count=1)


@dataclass(frozen=True)
class LayerRenaming:
    """Rename local layer numbers through an explicit table (VPP: a rank's chunks hold non-contiguous
    global layers, e.g. pp=2, vpp=2 puts layers 0 and 2 on stage 0 as its local layers 0 and 1)."""

    global_index: tuple[int, ...]
    pattern: str = r"^layers\.(\d+)"

    def __call__(self, name: str) -> str:
        return re.sub(self.pattern, lambda m: m.group(0)[: m.start(1) - m.start(0)]
                      + str(self.global_index[int(m.group(1))]), name, count=1)
