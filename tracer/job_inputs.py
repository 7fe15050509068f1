"""What a job starts from and what its reference leaves behind, as the recipe says: the weights (the
consistent generator, or `init.checkpoint`), the optimizer state (`init.checkpoint`), the global batch
of every step (synthetic, or `data.path`), and the reference's final state (`checkpoint.save`).
Part of the session (tracer/job.py): `tr.init_weights`, `tr.load_optimizer_state`, `tr.token_batch`,
`tr.save_checkpoint`, `tr.start_step`.

A run started from a checkpoint written after S optimizer steps continues from there: Adam's step
count is S, and the job's step i reads data step S + i (its trace still names it step i).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tracer.checkpoint import ADAM_STATE, Checkpoint, check_names, open_checkpoint, refuse, save_checkpoint
from tracer.checkpoint_gather import assembled_on_rank0, refusal
from tracer.errors import ConfigError
from tracer.generator import token_batch
from tracer.parameters import init_parameters, logical_params, mesh_axes_of, param_layout_map
from tracer.plan import Plan, Rename, logical_names

Cut = Callable[[torch.Tensor], torch.Tensor]   # a sliced state tensor cut to what the optimizer steps


def _dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if _dtensor(t) else t.detach()


class JobInputs:
    """Mixed into `tracer.job.Session` (which provides config, spec, role, seed, steps, rank, world_size)."""

    config: Any
    _ckpt: Checkpoint | None = None
    _weights_set = False
    _batches_read = False
    _saved = False
    plan: Plan | None = None        # the plan it was attached with

    @property
    def checkpoint(self) -> Checkpoint | None:
        """The checkpoint of `init.checkpoint` (tracer.checkpoint), or None."""
        path = (self.config.spec.get("init") or {}).get("checkpoint")
        if path and self._ckpt is None:
            self._ckpt = open_checkpoint(str(path))
        return self._ckpt if path else None

    @property
    def start_step(self) -> int:
        """Optimizer steps taken before this run: the checkpoint's (0 without one, or for a checkpoint
        that does not record them: Hugging Face, DCP)."""
        ck = self.checkpoint
        return ck.step if ck is not None else 0

    def init_weights(self, model: nn.Module, plan: Plan | None = None, *, rename: Rename | None = None,
                     coords: Mapping[str, int] | None = None, sizes: Mapping[str, int] | None = None,
                     init: Callable[[str, nn.Module], str] | None = None, std: float = 0.02) -> None:
        """Fill every parameter with its full logical tensor by global name, sliced by its layout, so
        every layout starts from the same weights whatever order it builds its modules in: from
        `init.checkpoint` when the recipe sets it (missing, extra or misshapen names: ConfigError on
        every rank), else from the consistent generator (`tracer.full_tensor`; `init(name, module)`
        returns "normal", "ones" or "zeros"; default: norms ones/zeros, biases zeros, the rest
        normal(0, std)). Under ttrace with a checkpoint, call it on every rank (its names are gathered)."""
        coords, sizes = mesh_axes_of(model, coords, sizes, plan, None, self.config.rank,
                                     self.config.world_size)
        layouts = param_layout_map(model, plan)
        ck, source = self.checkpoint, None
        if ck is not None:
            expected = {g: s for g, _, _, s in logical_params(model, layouts, sizes, rename).values()}
            buffers = {logical_names(rename)(n) for n, _ in model.named_buffers()}
            every = _gather(expected, buffers, self.config.world_size)
            if every is None:   # several ranks, no process group yet: this rank's names only
                refuse(ck, check_names(ck, expected, None))
            else:
                refuse(ck, check_names(ck, every[0], set(every[0]), ignore=every[1]))
            source = lambda gname, shape: ck.tensor(gname)
        init_parameters(model, layouts, self.config.seed, coords, sizes, rename=rename, init=init, std=std,
                        source=source)
        self._weights_set = True

    @torch.no_grad()
    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, model: nn.Module,
                             plan: Plan | None = None, *, params: Sequence[torch.Tensor | None] | None = None,
                             shard: Cut | Sequence[Cut | None] | None = None,
                             rename: Rename | None = None, coords: Mapping[str, int] | None = None,
                             sizes: Mapping[str, int] | None = None) -> bool:
        """Adam's state (exp_avg, exp_avg_sq, step) from `init.checkpoint`, sliced like the parameters;
        False (the optimizer starts fresh) without a checkpoint or when it holds no optimizer state.
        `params`: the tensors `optimizer` steps, one per parameter in `model.named_parameters()` order
        (FP32 master copies; default the parameters; None: this rank steps none of that parameter);
        `shard(t)` cuts a sliced state tensor further (ZeRO-1: this DP rank's chunk), one for all
        parameters or one per parameter (None: not cut). Master copies of lower-precision parameters
        (`_master`) take the checkpoint's weights too, at the precision it holds them in: built from the
        loaded BF16 parameters, they had lost what `save_checkpoint` kept."""
        ck = self.checkpoint
        if ck is None or (not ck.optimizer and params is None):   # nothing to load: no state, no masters
            return False
        coords, sizes = mesh_axes_of(model, coords, sizes, plan, None, self.config.rank,
                                     self.config.world_size)
        named = logical_params(model, param_layout_map(model, plan), sizes, rename)
        owners = list(params) if params is not None else [p for _, p, _, _ in named.values()]
        if len(owners) != len(named):
            raise ConfigError(f"load_optimizer_state: {len(owners)} optimizer tensors for {len(named)} "
                              "parameters; pass one per parameter, in model.named_parameters() order")
        cuts = list(shard) if isinstance(shard, Sequence) else [shard] * len(owners)
        if len(cuts) != len(owners):
            raise ConfigError(f"load_optimizer_state: {len(cuts)} shard cuts for {len(owners)} parameters; "
                              "pass one per parameter, in model.named_parameters() order")
        for (gname, param, layout, _), owner, cut in zip(named.values(), owners, cuts, strict=True):
            if owner is not None and _master(owner, param):
                local = layout.local(ck.tensor(gname), coords, sizes)
                owner.copy_(_like(cut(local) if cut is not None else local, owner, f"{gname} (its master)"))
        if not ck.optimizer:
            return False
        for (gname, _, layout, _), owner, cut in zip(named.values(), owners, cuts, strict=True):
            if owner is None:   # another rank steps this parameter (a distributed optimizer's range)
                continue
            state: dict[str, Any] = {"step": torch.tensor(float(ck.step))}
            for k, full in ck.adam_state(gname).items():
                local = layout.local(full, coords, sizes)
                local = cut(local) if cut is not None else local
                state[k] = _like(local, owner, f"{gname}.{k}")
            optimizer.state[owner] = state
        return True

    @torch.no_grad()
    def save_checkpoint(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                        params: Sequence[torch.Tensor] | None = None, rename: Rename | None = None) -> None:
        """`checkpoint.save=DIR`: the reference run writes its parameters and Adam state under their
        logical names (tracer.checkpoint) after its last step; a no-op in every other run. `params`
        as for `load_optimizer_state`: a master copy of a lower-precision parameter is written in its
        place (`_master`), so that a run resumed from the checkpoint steps the weights the optimizer
        stepped, not their BF16 rounding (Megatron-LM's checkpoints keep its FP32 main params too)."""
        directory = (self.config.spec.get("checkpoint") or {}).get("save")
        if not directory or self.config.role != "reference":
            return
        rename = logical_names(rename)
        named = list(model.named_parameters())
        owners = list(params) if params is not None else [p for _, p in named]
        several = self.config.world_size != 1
        plan_layouts = param_layout_map(model, self.plan) if several and self.plan is not None else None
        if several:   # tracer/checkpoint_gather.py
            pp = int(((self.config.spec.get("parallel") or {}).get("pp")) or 1)
            why = refusal(named, owners, pp, plan_layouts)
            if why is not None:
                raise ConfigError(f"checkpoint.save={directory}: the reference runs on "
                                  f"{self.config.world_size} ranks (reference.parallel) and {why}; save "
                                  "from a single-device reference (reference.parallel=single)")
        whole_master = lambda o, p: o is not None and _master(o, p) and o.numel() == p.numel()
        tensors = {rename(n): _full(o).reshape(p.shape) if whole_master(o, p) else _full(p)
                   for (n, p), o in zip(named, owners, strict=True)}
        adam: dict[str, dict[str, torch.Tensor]] = {}
        steps = [int(s["step"]) for s in (optimizer.state.values() if optimizer is not None else ())
                 if "step" in s]
        if steps:
            for (n, p), owner in zip(named, owners, strict=True):
                st = optimizer.state.get(owner) or {}   # type: ignore[union-attr]
                # A parameter that never had a grad has no Adam state: its moments are zero.
                adam[rename(n)] = {k: _full(st[k]) if k in st else torch.zeros(p.shape, dtype=torch.float32)
                                   for k in ADAM_STATE}
        if plan_layouts is not None:   # several ranks' shards, as the plan lays them out
            whole = assembled_on_rank0(tensors, adam, {rename(n): plan_layouts[n] for n, _ in named},
                                       self.coords, self.sizes)
            tensors, adam = whole if whole is not None else ({}, {})
        self._saved = True
        if self.config.rank != 0:   # rank 0 writes what every rank gathered
            return
        spec = self.config.spec
        save_checkpoint(str(directory), tensors, adam, {
            "step": max(steps) if steps else self.start_step + int(self.config.steps or 0),
            "seed": self.config.seed, "fingerprint": self.config.fingerprint,
            "model": spec.get("model"), "precision": (spec.get("precision") or {}).get("name"),
            "job": (spec.get("job") or {}).get("label"),
            "started_from": self.checkpoint.path if self.checkpoint is not None else None})

    def token_batch(self, step: int, global_batch: int, seq_len: int, vocab: int) -> torch.Tensor:
        """Token ids [global_batch, seq_len + 1] of the job's step `step` (data step start_step + step):
        windows of `data.path` (tracer.token_data) when the recipe sets it, else the consistent
        generator's tokens. The same global batch in every layout: cut it by data parallelism."""
        self._batches_read = True
        data, step = self.config.spec.get("data") or {}, self.start_step + step
        if data.get("path"):
            from tracer.token_data import open_tokens

            tokens = open_tokens(str(data["path"]), str(data.get("dtype") or "uint16"))
            return tokens.batch(self.config.seed, step, global_batch, seq_len, vocab)
        return token_batch(self.config.seed, step, global_batch, seq_len, vocab)

    def _inputs_unused(self, attaching: bool) -> str | None:
        """A recipe input the job never took (it would run on without it, silently): why, or None."""
        spec = self.config.spec
        if attaching:
            if (spec.get("init") or {}).get("checkpoint") and not self._weights_set:
                return ("init.checkpoint is set but the job did not call tr.init_weights(model, ...) before "
                        "tr.attach: its weights would not come from the checkpoint")
            return None
        if (spec.get("data") or {}).get("path") and not self._batches_read:
            return ("data.path is set but the job never read a batch through tr.token_batch(step, ...): it "
                    "trained on other data")
        if ((spec.get("checkpoint") or {}).get("save") and self.config.role == "reference"
                and not self._saved):
            return "checkpoint.save is set but the job never called tr.save_checkpoint(model, optimizer)"
        return None


def _gather(expected: dict[str, tuple[int, ...]], buffers: set[str],
            world_size: int) -> tuple[dict[str, tuple[int, ...]], set[str]] | None:
    """Every rank's parameter names and shapes, and buffer names; None when they cannot be known (several
    ranks and no process group)."""
    if world_size == 1:
        return expected, buffers
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, (expected, sorted(buffers)))
    return ({n: s for e, _ in out for n, s in e.items()}, {b for _, bs in out for b in bs})


def _master(owner: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether the optimizer steps `owner` as a master copy of `param` (or of its range) at a higher
    precision (BF16 parameters' FP32 masters). Masters of the parameter's own dtype hold its values
    already (and a perturbed run's moved weights: never overwritten)."""
    return (owner is not param and not _dtensor(owner) and owner.dtype.is_floating_point
            and owner.dtype.itemsize > param.dtype.itemsize)


def _like(local: torch.Tensor, owner: torch.Tensor, what: str) -> torch.Tensor:
    """`local` as `owner`'s state: its dtype and device; a DTensor with its placements for a DTensor."""
    if _dtensor(owner):
        from torch.distributed.tensor import DTensor

        local_owner = owner._local_tensor   # type: ignore[attr-defined]
        if tuple(local.shape) != tuple(local_owner.shape):
            raise ConfigError(f"init.checkpoint: {what} slices to {list(local.shape)} on this rank, the "
                              f"optimizer's shard is {list(local_owner.shape)}")
        return DTensor.from_local(local.to(local_owner.dtype, copy=True).to(local_owner.device),
                                  owner.device_mesh, owner.placements, run_check=False, shape=owner.shape,
                                  stride=owner.stride())
    if tuple(local.shape) != tuple(owner.shape):
        raise ConfigError(f"init.checkpoint: {what} slices to {list(local.shape)} on this rank, the "
                          f"optimizer's tensor is {list(owner.shape)}")
    return local.to(device=owner.device, dtype=owner.dtype, copy=True).contiguous()
