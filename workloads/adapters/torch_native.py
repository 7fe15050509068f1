"""job=torch_native: a torchtitan-style Llama parallelized with torch's own APIs, traced with
layouts read from DTensor placements (tracer/integrations/dtensor.py), with no tracing plan.

The model (RMSNorm, RoPE, SwiGLU, GQA, optional tied embeddings; module names as torchtitan's) is
free of parallelism. `parallelize` applies, like torchtitan's `parallelize_llama`:

- TP (+SP): `parallelize_module` with ColwiseParallel / RowwiseParallel / SequenceParallel /
  PrepareModuleInput on a mesh dim named "tp";
- DP: `fully_shard` (FSDP2) per block and at the root on the mesh dim named "dp";
- PP (pp > 1): torch.distributed.pipelining, each stage cut from the whole model and parallelized as
  above (workloads/adapters/torch_pipeline.py, like torchtitan's `pipeline_llama`).

GQA with fewer KV heads than TP ranks (llama_tiny: 1 KV head, tp=2) cannot shard wk/wv column-wise
(a head would be split). They are then replicated (`ReplicatedKV`): every TP rank computes the whole
K/V, and its local gradient is declared `Partial` (each rank backpropagates only its own query
heads), so DTensor all-reduces the wk/wv weight grads.

Weights: every parameter is generated as its full logical tensor by global name (`tr.init_weights`,
the consistent generator) before parallelization; torch's `distribute_tensor` then keeps each rank's
shard, so reference and candidate start bit-identical. The session perturbs them (perturbed role)
and reads every layout from DTensor placements when it attaches, after parallelization.

Precision (`precision=fp32|bf16`): bf16 is torchtitan's mixed precision, FSDP2's
`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`: FP32 parameters, Adam and
gradients, each parameter cast to BF16 where it is used, BF16 activations, gradients reduced in FP32.
Under FSDP2 (dp > 1) the policy is FSDP2's own; without it (torchtitan then falls back on autocast)
the modules cast their parameters themselves, the same casts. GEMMs run as a GPU runs them (FP32
accumulation of the BF16 operands, output rounded: workloads.precision.bf16_linear, emulated since a
BF16 matmul is ~130x slower on CPU); RoPE and attention in FP32 inside, BF16 out (flash-attention
style); the loss on FP32 logits. Perturbed references draw every GEMM result again at its rounding
(tolerance.perturbation=gemm, workloads/rounding_draws.py), as the built-in trainer's bf16 ones do: a
one-ulp move of an FP32 weight mostly vanishes in its BF16 cast.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tracer import ConfigError
from tracer.job import Session
from workloads import bugs, faults, harness, lr_schedule
from workloads.adapters import torch_pipeline
from workloads.config import Config, parse, recompute_refused
from workloads.llama import rotary
from workloads.precision import Precision, bf16_linear, perturbation_of, weights_refused
from workloads.rounding_draws import module_draw, perturbed_linear

SUPPORTED = ("parallel recipes with tp (+sp), dp (FSDP2) and pp (+vpp, torch.distributed.pipelining): "
             "single, tp2, tp2_sp, dp2, tp2_dp2, pp2, pp2_vpp2, tp2_pp2")
PRECISIONS = ("fp32", "bf16")


# -- the model (no parallelism in it) --------------------------------------------------------------
class CastsWeight(nn.Module):
    """A module computing with its weight cast to `compute` (set by `mixed_precision`), as FSDP2's
    mixed precision hands it; in FP32, with its own default GEMM, torch's forward untouched."""
    compute = torch.float32
    gemm = staticmethod(F.linear)   # Linear's: bf16_linear in bf16, drawn in perturbed runs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute == torch.float32 and self.gemm is F.linear:
            return super().forward(x)
        return self.cast_forward(x, self.weight.to(self.compute))


class Linear(CastsWeight, nn.Linear):
    def cast_forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, w)


class Embedding(CastsWeight, nn.Embedding):
    def cast_forward(self, tokens: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, w)


class RMSNorm(CastsWeight, nn.RMSNorm):
    def cast_forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, w, self.eps)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = heads, kv_heads, hidden // heads
        self.wq = Linear(hidden, heads * self.head_dim, bias=False)
        self.wk = Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wv = Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wo = Linear(heads * self.head_dim, hidden, bias=False)
        # First global query head and KV head held by this rank (set by `parallelize` under TP).
        self.q_offset, self.kv_offset = 0, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.head_dim
        # [b, local heads, s, d]; RoPE and attention in FP32 (a no-op in an FP32 model), BF16 out
        q = self.wq(x).view(b, s, -1, d).transpose(1, 2).float()
        k = self.wk(x).view(b, s, -1, d).transpose(1, 2).float()
        v = self.wv(x).view(b, s, -1, d).transpose(1, 2).float()
        pos = torch.arange(s, device=x.device)
        q, k = rotary(q, pos), rotary(k, pos)
        kv_of_q = (self.q_offset + torch.arange(q.shape[1], device=x.device)) // (self.n_heads // self.n_kv)
        idx = kv_of_q - self.kv_offset
        k, v = k.index_select(1, idx), v.index_select(1, idx)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(d))
        return self.wo(out.transpose(1, 2).reshape(b, s, -1).to(x.dtype))


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.w1 = Linear(hidden, ffn_hidden, bias=False)
        self.w2 = Linear(ffn_hidden, hidden, bias=False)
        self.w3 = Linear(hidden, ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        m = cfg.model
        self.attention_norm = RMSNorm(m.hidden, eps=1e-5)
        self.attention = Attention(m.hidden, m.heads, m.num_kv_heads)
        self.ffn_norm = RMSNorm(m.hidden, eps=1e-5)
        self.feed_forward = FeedForward(m.hidden, m.ffn_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        m = cfg.model
        self.tok_embeddings: Embedding | None = Embedding(m.vocab, m.hidden)
        # keyed by layer id, as torchtitan's: a pipeline stage deletes the others' layers and keeps the
        # global names (workloads/adapters/torch_pipeline.py)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(m.layers)})
        self.norm: RMSNorm | None = RMSNorm(m.hidden, eps=1e-5)
        self.output: Linear | None = Linear(m.hidden, m.vocab, bias=False)
        self.tied = m.tie_embeddings
        if self.tied:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids to logits; a pipeline stage's part of it (a stage without the embedding takes
        the previous stage's hidden states, one without the head returns its own)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def mixed_precision(model: Transformer, precision: str, draws: int | None, draw_stream: int) -> None:
    """The modules' compute dtype and GEMM (module doc); `draws`: a perturbed run's seed for rounding
    draws on every GEMM result (forward output, input grad). `draw_stream`: the rank's data
    coordinate, so each rank's microbatches get draws of their own; TP ranks share a stream, so a
    GEMM replicated over TP (the K/V projections of few KV heads) stays bitwise one replica."""
    compute = Precision(precision).param_dtype
    for name, m in model.named_modules():
        if isinstance(m, CastsWeight):
            m.compute = compute
        if isinstance(m, Linear):
            m.gemm = bf16_linear if compute == torch.bfloat16 else F.linear
            if draws is not None:
                m.gemm = perturbed_linear(m.gemm, module_draw(draws, name, draw_stream, precision))


# -- parallelization (torch's own APIs) ------------------------------------------------------------
def _replicated_kv_style() -> Any:
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class ReplicatedKV(ParallelStyle):
        """Replicated K/V projection under TP (GQA with fewer KV heads than TP ranks): each rank's
        output gradient only covers its own query heads, so it is a Partial sum over TP."""

        @staticmethod
        def _in(mod: nn.Module, inputs: tuple, mesh: Any) -> tuple:
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
            return (x,)

        @staticmethod
        def _out(mod: nn.Module, out: Any, mesh: Any) -> torch.Tensor:
            return out.to_local(grad_placements=(Partial(),))

        def _apply(self, module: nn.Module, mesh: Any) -> nn.Module:
            return distribute_module(module, mesh, None, self._in, self._out)

    return ReplicatedKV()


def parallelize(model: Transformer, mesh: Any, cfg: Config) -> None:
    """torchtitan's recipe: TP(+SP) plan per block, activation checkpointing (parallel.recompute), then
    FSDP2 per block (but under a zero-bubble schedule: torch_pipeline.fsdp_per_block) and at the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    m, sp = cfg.model, cfg.parallel.sp
    tp_mesh, tp = mesh["tp"], mesh["tp"].size()
    if tp > 1:
        seq = Shard(1) if sp else Replicate()   # layout of the residual stream between blocks
        top: dict[str, Any] = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
        }
        if sp:
            top["norm"] = SequenceParallel()
        # a pipeline stage holds some of them (or none)
        top = {name: style for name, style in top.items() if getattr(model, name) is not None}
        if top:
            parallelize_module(model, tp_mesh, top)
        tp_rank = tp_mesh.get_local_rank()
        kv_sharded = m.num_kv_heads % tp == 0
        for block in model.layers.values():
            kv = ColwiseParallel() if kv_sharded else _replicated_kv_style()
            if not kv_sharded and bugs.active(cfg.bug, "tn_gqa_kv_gathered_output"):
                # BUG tn_gqa_kv_gathered_output: too few KV heads to shard, so the plan shards wk/wv
                # column-wise and gathers their output (`output_layouts=Replicate()`). The forward is
                # right, but `to_local()` then declares each rank's K/V gradient replicated while it only
                # holds that rank's query heads' part: the grads of wk/wv (and of their input) lose the
                # other ranks' contributions.
                kv = ColwiseParallel(output_layouts=Replicate())
            plan: dict[str, Any] = {
                "attention.wq": ColwiseParallel(), "attention.wk": kv, "attention.wv": kv,
                "attention.wo": RowwiseParallel(output_layouts=seq),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=seq),
            }
            if sp:
                plan.update({
                    "attention_norm": SequenceParallel(),
                    "attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                                    desired_input_layouts=(Replicate(),)),
                    "ffn_norm": SequenceParallel(),
                    "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                       desired_input_layouts=(Replicate(),)),
                })
            parallelize_module(block, tp_mesh, plan)
            block.attention.q_offset = tp_rank * (m.heads // tp)
            block.attention.kv_offset = tp_rank * (m.num_kv_heads // tp) if kv_sharded else 0
        if model.tied:   # parallelize_module made two DTensor copies (both Shard(0)): tie them again
            model.output.weight = model.tok_embeddings.weight
    if cfg.parallel.recompute == "full":
        # torchtitan's apply_ac (mode "full"), between TP and FSDP: each block wrapped for non-reentrant
        # activation checkpointing. The wrapper's attribute is no part of a traced name (tracer.plan).
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for key, block in list(model.layers.items()):
            model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False)
    if mesh["dp"].size() > 1:
        # torchtitan's mixed precision: FSDP2 casts the parameters it gathers and reduces grads in FP32
        mp = MixedPrecisionPolicy(param_dtype=Precision(cfg.precision).param_dtype,
                                  reduce_dtype=torch.float32)
        if torch_pipeline.fsdp_per_block(cfg):
            for block in model.layers.values():
                fully_shard(block, mesh=mesh["dp"], mp_policy=mp)
        fully_shard(model, mesh=mesh["dp"], mp_policy=mp)


def clip_grad_norm(model: nn.Module, max_norm: float, pp_group: Any = None) -> float:
    """Global-norm clipping over logical grads (a DTensor grad counts once, whatever its shards).
    `pp_group`: pipeline stages hold different parameters, and a DTensor's placements say nothing of
    pp, so the stages' sums of squares are added over it (torchtitan #596, fixed by its PR #649)."""
    from torch.distributed.tensor import DTensor

    sq = torch.zeros((), dtype=torch.float32)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for g in grads:
        full = g.full_tensor() if isinstance(g, DTensor) else g
        sq = sq + full.float().pow(2).sum()
    if pp_group is not None:
        torch.distributed.all_reduce(sq, group=pp_group)
    total = math.sqrt(sq.item())
    coef = max_norm / (total + 1e-6)
    if max_norm > 0 and coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total


def train(model: nn.Module, job: harness.RankJob, dp_rank: int, dp_size: int, dp_group: Any,
          autocast: torch.dtype | None = None, *, pipeline: torch_pipeline.Pipeline | None = None,
          rename: Any = None) -> list[float]:
    """`steps` steps of Adam on this DP rank's microbatches (grad accumulation, loss / local count,
    DP averaging left to the framework); traced by the job's session. `autocast`: the forward runs
    under torch.autocast to that dtype, as Hugging Face's Trainer runs it (backward outside it).
    `pipeline`: this rank's pipeline stages run each step's microbatches instead (`model`, `rename`:
    what the session attached). Returns the global mean loss per step (none off the last stage)."""
    cfg, tracer = job.cfg, job.session
    m_local = cfg.micro_batches_local
    # a pipeline backpropagates each microbatch's own mean loss (its schedule divides the grads after)
    tracer.set_grad_scale((m_local if pipeline is None else 1) / cfg.micro_batches_global)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                                 weight_decay=0.0, foreach=False)
    tracer.load_optimizer_state(optimizer, model, rename=rename)   # init.checkpoint's Adam state
    # torch DDP (job=hf's dp): grads accumulate locally and are all-reduced in the last microbatch's
    # backward, as the Trainer's accelerate runs it (`no_sync` around the others)
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    # BUG hf_ddp_grads_never_synced: the last microbatch runs inside no_sync too
    never_synced = bugs.active(cfg.bug, "hf_ddp_grads_never_synced")
    step_losses: list[float] = []
    scheduler = lr_schedule.Scheduler(cfg)
    for step in range(cfg.steps):
        with tracer.step(step):
            optimizer.zero_grad(set_to_none=True)
            batches = job.microbatches(step, dp_rank, dp_size)
            losses = [] if pipeline is None else pipeline.step(batches)
            for j, mb in enumerate(batches if pipeline is None else ()):
                synced = not ddp or (j == len(batches) - 1 and not never_synced)
                with contextlib.nullcontext() if synced else model.no_sync():
                    with tracer.microbatch(mb.index), torch.autocast(mb.ids.device.type, dtype=autocast,
                                                                     enabled=autocast is not None):
                        logits = model(mb.ids)
                        logits = getattr(logits, "logits", logits)   # Hugging Face's output object
                        loss = F.cross_entropy(logits.float().flatten(0, 1), mb.labels.flatten())
                    tracer.record_loss(loss.detach(), microbatch=mb.index)
                    losses.append(loss.item())
                    (loss / m_local).backward()   # FSDP2 and DDP average over dp
            faults.maybe_inject(job.spec, job.rank, step)
            tracer.record_param_grads(model)
            clip_grad_norm(model, cfg.clip_grad, None if pipeline is None else pipeline.clip_group)
            scheduler.set(optimizer)
            optimizer.step()
            scheduler.step(cfg.global_batch)
            tracer.record_params(model)
        if pipeline is None or pipeline.last:
            step_losses.append(job.mean_loss(losses, dp_group))
    tracer.save_checkpoint(model, optimizer)   # checkpoint.save (the reference only)
    return step_losses


# -- adapter contract ------------------------------------------------------------------------------
def rank_imports() -> None:
    """What every rank imports, for the fork server to import once before forking them
    (orchestrator/fork_server.py rank_imports): the tracer's DTensor integration (numba with it)."""
    import tracer.integrations.dtensor  # noqa: F401


def validate(spec: dict) -> None:
    cfg = parse(spec)
    m, p = cfg.model, cfg.parallel
    where = f"job=torch_native, parallel={p.name}, model={m.name}"

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(f"{where}: {msg}")

    need(m.arch == "llama", "the torch-native model is a Llama (RMSNorm, RoPE, SwiGLU); use model=llama_tiny")
    need(p.cp == 1 and p.ep == 1 and not p.zero1,
         f"only TP, SP, FSDP2 data parallelism and pipelining are wired ({SUPPORTED})")
    need(p.world_size == p.pp * p.tp * p.dp and p.dp >= 1, f"world_size={p.world_size} must be pp*tp*dp")
    if p.pp > 1:
        stages = p.pp * p.vpp
        need(not m.tie_embeddings, "tied embeddings under pp: the embedding and the output layer sit on "
             "different stages and torch's pipelining keeps no shared parameter in sync (torchtitan "
             "refuses the pair too); add ++model.tie_embeddings=false")
        need(m.layers % stages == 0, f"layers={m.layers} must be divisible by pp*vpp={stages} (stages)")
        need(cfg.micro_batches_local % p.pp == 0,
             f"{cfg.micro_batches_local} microbatches per DP rank: the pipeline schedule needs a multiple "
             f"of pp={p.pp} (raise data.global_batch or lower data.micro_batch)")
    need(p.vpp == 1 or p.pp > 1, f"vpp={p.vpp} needs pp > 1 (stages per pipeline rank)")
    need(not p.pp_schedule or p.pp > 1, f"parallel.pp_schedule={p.pp_schedule} needs pp > 1")
    why = torch_pipeline.schedule_refused(cfg) if p.pp > 1 else None
    need(why is None, str(why))
    need(not p.sp or p.tp > 1, "sp needs tp > 1")
    need(cfg.precision in PRECISIONS, f"precision={cfg.precision}: the torch-native recipe runs "
         f"{' or '.join(PRECISIONS)}")
    need((why := weights_refused(spec)) is None, str(why))
    tp = p.tp
    need(m.heads % tp == 0, f"heads={m.heads} must be divisible by tp={tp}")
    need(m.heads % m.num_kv_heads == 0, f"heads={m.heads} must be a multiple of kv_heads={m.num_kv_heads}")
    need(m.num_kv_heads % tp == 0 or tp % m.num_kv_heads == 0,
         f"kv_heads={m.num_kv_heads} and tp={tp}: KV heads are sharded (kv_heads % tp == 0) or "
         "replicated (tp % kv_heads == 0)")
    need(m.ffn_hidden % tp == 0 and m.vocab % tp == 0 and m.hidden % m.heads == 0,
         "ffn_hidden and vocab must be divisible by tp")
    need(not p.sp or m.seq_len % tp == 0, f"seq_len={m.seq_len} must be divisible by tp under sp")
    need(cfg.global_batch % (p.dp * cfg.micro_batch) == 0,
         f"data.global_batch={cfg.global_batch} must be divisible by dp*micro_batch")
    ours = sorted(n for n, b in bugs.CATALOG.items() if b.job == "torch_native")
    need(cfg.bug == bugs.NONE or cfg.bug in ours,
         f"bug={cfg.bug} is not a torch-native bug; known: {', '.join(ours)} (or 'none')")
    need(cfg.steps >= 1, "steps must be >= 1")
    need((why := recompute_refused(p.recompute, selective=False)) is None, str(why))


def main(session: Session | None = None) -> dict[str, Any]:
    """One rank of the torch-native job (an entrypoint of the job contract)."""
    from torch.distributed.device_mesh import init_device_mesh

    with harness.rank_job(validate, session) as job:
        cfg, tr, p = job.cfg, job.session, job.cfg.parallel
        if p.pp > 1:   # torchtitan's mesh order: pp outermost
            mesh = init_device_mesh("cpu", (p.pp, p.dp, p.tp), mesh_dim_names=("pp", "dp", "tp"))
        else:
            mesh = init_device_mesh("cpu", (p.dp, p.tp), mesh_dim_names=("dp", "tp"))
        model = Transformer(cfg)
        tr.init_weights(model)                 # full logical weights, before sharding
        moves = perturbation_of(job.spec)
        draws = tr.perturb if tr.role == "perturbed" and moves == "gemm" else None
        dp = mesh["dp"]
        parts = torch_pipeline.stage_modules(model, cfg, mesh["pp"].get_local_rank() if p.pp > 1 else 0)
        for _, part in parts:
            mixed_precision(part, cfg.precision, draws, dp.get_local_rank())
            parallelize(part, mesh, cfg)
        traced, rename = torch_pipeline.traced_model(parts)
        # layouts from DTensor placements; the role applied (weights moved, or GEMM draws above)
        tr.attach(traced, mesh=mesh, rename=rename, perturb=moves == "weights", meta={"perturbation": moves})
        pipeline = torch_pipeline.Pipeline(parts, cfg, mesh, tr, job.device) if p.pp > 1 else None
        return {"losses": train(traced, job, dp.get_local_rank(), p.dp, dp.get_group() if p.dp > 1 else None,
                                pipeline=pipeline, rename=rename)}
