"""job=megatron_core: megatron-core's own GPTModel, DDP wrapper, pipeline schedules and grad
finalization, run on CPU (gloo) and traced by ttrace.

The model is megatron-core's `GPTModel` with its local (non-Transformer-Engine) layer spec; its TP/SP
layers, `DistributedDataParallel`, `get_forward_backward_func()` schedules, `finalize_model_grads` and
optimizer (`get_megatron_optimizer`: Adam under its grad-norm clipping, and with `parallel.zero1` its
`DistributedOptimizer`, ZeRO-1 over DP) are the real library code, and with `parallel.vpp` its
interleaved schedule over model chunks (one DDP each). This adapter only builds them from
the recipe and initializes weights consistently (tracer.full_tensor, sliced by the plan read from
megatron's module attributes). The CPU shims live in `megatron_shims`. It is an entrypoint of the job
contract (`main`) on the shared per-rank harness (workloads/harness.py).

`precision=bf16` is Megatron-LM's: each chunk in megatron's `Float16Module`, FP32 main grads reduced in
FP32, megatron's mixed-precision optimizer stepping FP32 main params; the schedule's forwards and
backwards run under workloads.bf16_dispatch.GpuBF16 (BF16 GEMMs, LayerNorm and embedding grads as a GPU
computes them), and a perturbed reference draws every linear layer's GEMM roundings (`_draw_gemms`).

Under the distributed optimizer, each DP rank's grad buffer holds the reduced grad only in the range
of each parameter it owns (the rest is its own unreduced contribution): a rank records each parameter's
grad as those elements and zeros elsewhere, a partial sum over `dp` whose ranks' summands add up to the
reduced grad exactly (`_owned_grads`). A range that two ranks own, or none, shows in that sum. The
summands are disjoint (`Layout.disjoint`), so stats mode and scans keep their statistics, not their values.

Bugs (workloads/bugs.py, `job="megatron_core"`) are injected by patching the real megatron-core
function at fault for the duration of the job, its model's build included (`_inject`), or, for
`megatron_vpp_pp2_p2p_crossed`, by keeping megatron's default where the job changes it (`_config`).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tracer import Layout, Replicate, param_layouts
from tracer.errors import ConfigError
from tracer.job import Session
from workloads import bugs, faults, harness, lr_schedule
from workloads.adapters import megatron_shims
from workloads.bf16_dispatch import GpuBF16
from workloads.config import pp_schedule_refused, recompute_refused
from workloads.precision import perturbation_of, weights_refused
from workloads.rounding_draws import drawn, grad_drawn, module_draw

NAME = "megatron_core"
PRECISIONS = ("fp32", "bf16")
SUPPORTED_PARALLEL_KEYS = ("name", "world_size", "tp", "pp", "sp")


def _bugs() -> list[str]:
    return sorted(n for n, b in bugs.CATALOG.items() if b.job == NAME)


def rank_imports() -> None:
    """What every rank imports, for the fork server to import once before forking them
    (orchestrator/fork_server.py rank_imports): megatron-core with its CPU shims, as `main` installs
    them (2-3 s of CPU: its fused ops' torch.compile decorators import torch._inductor). Not at this
    module's import, which the driver's recipe validation pays."""
    megatron_shims.install()
    for module in ("megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs",
                   "megatron.core.distributed", "megatron.core.distributed.finalize_model_grads",
                   "megatron.core.pipeline_parallel", "megatron.core.optimizer",
                   "megatron.core.transformer.module", "tracer.integrations.megatron_core"):
        importlib.import_module(module)


# -- validation ----------------------------------------------------------------------------------
def validate(spec: Mapping[str, Any]) -> None:
    m, p = spec["model"], spec["parallel"]
    where = f"job={NAME}, parallel={p.get('name')}, model={m.get('name')}"

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(f"{where}: {msg}")

    need(m.get("arch", "gpt") == "gpt" and not m.get("experts"),
         "only the GPT architecture is wired to megatron-core's GPTModel; use model=gpt_tiny")
    for key in ("cp", "ep"):
        need(int(p.get(key, 1) or 1) == 1, f"{key}={p.get(key)} is not supported by the megatron-core "
             "adapter (supported: tp, sp, pp, vpp, dp); use parallel=tp2, tp2_sp, pp2 or pp2_vpp2")
    tp, pp, ws = int(p.get("tp", 1)), int(p.get("pp", 1)), int(p["world_size"])
    need(ws % (tp * pp) == 0, f"world_size={ws} is not a multiple of tp*pp={tp * pp}")
    dp = ws // (tp * pp)
    need(m["heads"] % tp == 0, f"heads={m['heads']} must be divisible by tp={tp} (whole QKV groups per rank)")
    need(m["vocab"] % tp == 0, f"vocab={m['vocab']} must be divisible by tp={tp}")
    need(m["ffn_hidden"] % tp == 0, f"ffn_hidden={m['ffn_hidden']} must be divisible by tp={tp}")
    need(m["layers"] % pp == 0, f"layers={m['layers']} must be divisible by pp={pp}")
    vpp = int(p.get("vpp", 1) or 1)
    need(vpp == 1 or pp > 1, f"vpp={vpp} needs pp > 1 (model chunks per pipeline rank)")
    need(m["layers"] % (pp * vpp) == 0, f"layers={m['layers']} must be divisible by pp*vpp={pp * vpp}")
    need(not p.get("sp") or (tp > 1 and m["seq_len"] % tp == 0),
         f"sp needs tp > 1 and seq_len={m['seq_len']} divisible by tp={tp}")
    gb, mb = int(spec["data"]["global_batch"]), int(spec["data"]["micro_batch"])
    need(gb % (mb * dp) == 0, f"global_batch={gb} must be divisible by micro_batch*dp={mb * dp}")
    need(vpp == 1 or (gb // (mb * dp)) % pp == 0, f"megatron's interleaved schedule needs the rank's "
         f"{gb // max(1, mb * dp)} microbatches to be a multiple of pp={pp}")
    precision = (spec.get("precision") or {}).get("name", "fp32")
    need(precision in PRECISIONS, f"precision={precision}: megatron-core runs fp32 or bf16 here (its fp8 "
         "needs Transformer Engine)")
    need((why := weights_refused(spec)) is None, str(why))
    bug = bugs.bug_name(spec)
    need(bug == bugs.NONE or bug in _bugs(),
         f"bug={bug} is not a megatron-core bug; known: {', '.join(_bugs())} (or 'none')")
    need(int(spec["steps"]) >= 1, f"steps={spec['steps']} must be >= 1")
    need((why := recompute_refused(p.get("recompute") or "none", selective=True)) is None, str(why))
    need((why := pp_schedule_refused(str(p.get("pp_schedule") or ""))) is None, str(why))


# -- bug injection: patch the real megatron-core function at fault -------------------------------
@contextlib.contextmanager
def _inject(bug: str) -> Iterator[None]:
    """Patch megatron-core for one job, restore on exit (Ray reuses worker processes)."""
    # the modules (the package re-exports the function under the module's name)
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    layers = importlib.import_module("megatron.core.tensor_parallel.layers")

    patches: list[tuple[Any, str, Any]] = []
    if bug == "megatron_sp_layernorm_grad_unreduced":
        real = fmg._allreduce_non_tensor_model_parallel_grads

        def allreduce_without_sp(model, config, tp_group=None):  # noqa: ANN001 - megatron's signature
            # BUG: the `config.sequence_parallel and param.sequence_parallel` branch is lost, so
            # LayerNorm grads (partial sums over each rank's sequence chunk) are never all-reduced.
            from dataclasses import replace
            return real(model, replace(config, sequence_parallel=False), tp_group)
        patches.append((fmg, "_allreduce_non_tensor_model_parallel_grads", allreduce_without_sp))
    elif bug == "megatron_sp_allgather_grad_unreduced":
        def reduce_scatter_without_reduce(output, input, group=None, async_op=False):  # noqa: A002
            # BUG: the backward of ColumnParallelLinear's sequence-parallel all-gather must
            # reduce-scatter the input grad over TP; this one only scatters (keeps the local partial).
            output.copy_(input.chunk(dist.get_world_size(group), dim=0)[dist.get_rank(group)])
            return _Done() if async_op else None
        patches.append((layers, "dist_reduce_scatter_func", reduce_scatter_without_reduce))
    elif bug == "megatron_zero1_gather_offset_wrong":
        buffers = importlib.import_module("megatron.core.distributed.param_and_grad_buffer")
        group_cls = buffers._ParamAndGradBucketGroup
        real_sync = group_cls.start_param_sync

        def start_param_sync_rotated(self, force_sync=False):  # noqa: ANN001, ANN202 - megatron's signature
            real_sync(self, force_sync)
            # BUG: the distributed optimizer's all-gather of the updated parameter shards lands shard i
            # at offset i-1 (synchronous here: overlap_param_gather is off).
            for bucket in self.buckets:
                dp = self.intra_distributed_optimizer_instance_size
                shards = buffers.shard_buffer(bucket.param_data, dp)
                bucket.param_data.copy_(torch.cat(shards[1:] + shards[:1]))
        patches.append((group_cls, "start_param_sync", start_param_sync_rotated))
    elif bug == "megatron_tied_embedding_grad_lost_pp":
        def word_embedding_grads_kept(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            return None   # BUG: the first and last stage's word-embedding grads are never summed
        patches.append((fmg, "_allreduce_word_embedding_grads", word_embedding_grads_kept))
    elif bug == "megatron_vpp_layer_offset_wrong":
        from megatron.core import parallel_state as mps
        real_offset = importlib.import_module("megatron.core.transformer.transformer_layer") \
            .get_transformer_layer_offset

        def offset_non_interleaved(config, vp_stage=None, pp_rank=None):  # noqa: ANN001, ANN202
            vpp = config.virtual_pipeline_model_parallel_size
            if not vpp or vp_stage is None:
                return real_offset(config, vp_stage, pp_rank)
            # BUG: a chunk's first layer by the non-interleaved formula (a rank's chunks hold consecutive
            # layers), not chunk-major: with pp=2, vpp=2 rank 0's second chunk is numbered layer 1, not 2.
            per_chunk = config.num_layers // (config.pipeline_model_parallel_size * vpp)
            rank = mps.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank
            return (rank * vpp + vp_stage) * per_chunk
        for module in ("transformer_layer", "transformer_block"):   # each calls it by its own name
            patches.append((importlib.import_module(f"megatron.core.transformer.{module}"),
                            "get_transformer_layer_offset", offset_non_interleaved))
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    for obj, attr, new in patches:
        setattr(obj, attr, new)
    try:
        yield
    finally:
        for obj, attr, old in saved:
            setattr(obj, attr, old)


class _Done:
    def wait(self) -> None:
        return None


# -- model ---------------------------------------------------------------------------------------
def _config(spec: Mapping[str, Any], tp: int, pp: int, sp: bool, vpp: int = 1) -> Any:
    from megatron.core.transformer import TransformerConfig

    m = spec["model"]
    bf16 = _bf16(spec)
    dtype = torch.bfloat16 if bf16 else torch.float32
    # parallel.recompute: megatron's own recomputation, its CheckpointFunction running each layer (full:
    # `--recompute-granularity full --recompute-method uniform --recompute-num-layers 1`) or each core
    # attention (selective: `--recompute-activations`) under no_grad and again in backward, its RNG
    # states saved and restored (megatron_shims).
    recompute = {"full": {"recompute_granularity": "full", "recompute_method": "uniform",
                          "recompute_num_layers": 1},
                 "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
                 }.get((spec.get("parallel") or {}).get("recompute") or "none", {})
    return TransformerConfig(
        num_layers=m["layers"], hidden_size=m["hidden"], num_attention_heads=m["heads"],
        ffn_hidden_size=m["ffn_hidden"], tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        sequence_parallel=sp, bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype,
        use_cpu_initialization=True, perform_initialization=False,   # ttrace's consistent init instead
        hidden_dropout=0.0, attention_dropout=0.0,
        # CPU: the unfused paths (no apex / Transformer Engine kernels)
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        # With vpp and pp=2, the interleaved schedule's ring makes a rank's next and previous stage the
        # same rank. Posted as one batch (megatron's default), its sends of an activation and of a grad to
        # that rank pair first-in first-out with the peer's receives, which it posts in the other order:
        # they cross, silently (Megatron-LM #750, #1450, PR #5271; measured here on gloo: microbatches 2
        # and 3 of a step computed on swapped tensors). One operation at a time pairs them right. The
        # catalog's megatron_vpp_pp2_p2p_crossed keeps the default.
        batch_p2p_comm=vpp == 1 or pp != 2 or bugs.bug_name(spec) == "megatron_vpp_pp2_p2p_crossed",
        **recompute)


def _build(spec: Mapping[str, Any], config: Any, vp_stage: int | None = None) -> torch.nn.Module:
    """This pipeline rank's model, or its chunk `vp_stage` under virtual pipelining."""
    from megatron.core import parallel_state as mps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = get_gpt_layer_local_spec()
    norm = megatron_shims.TorchNorm   # torch LayerNorm that accepts sequence parallelism
    layer.submodules.input_layernorm = norm
    layer.submodules.pre_mlp_layernorm = norm
    # this pipeline stage's layers (each numbers itself globally: `layer_number`)
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    block = TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=norm)
    m = spec["model"]
    return GPTModel(config, block, vocab_size=m["vocab"], max_sequence_length=m["seq_len"],
                    pre_process=mps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                    post_process=mps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                    share_embeddings_and_output_weights=bool(m.get("tie_embeddings")),
                    position_embedding_type="learned_absolute",
                    vp_stage=vp_stage)


# -- entry point ---------------------------------------------------------------------------------
def main(session: Session | None = None) -> dict[str, Any]:
    """One rank of the megatron-core job (an entrypoint of the job contract)."""
    with harness.rank_job(validate, session) as job:
        megatron_shims.install()
        from megatron.core import parallel_state as mps

        try:   # a bug is patched in from the model's build (a chunk's layer numbers are set there)
            with _inject(bugs.bug_name(job.spec)):
                return {"losses": _train(job)}
        finally:
            mps.destroy_model_parallel()


def _train(job: harness.RankJob) -> list[float]:
    from megatron.core import parallel_state as mps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    from tracer.integrations.megatron_core import chunks_renaming, layer_renaming, plan_for, tied_renaming

    spec, cfg, tracer = job.spec, job.cfg, job.session
    p = spec["parallel"]
    tp, pp, sp, vpp = int(p.get("tp", 1)), int(p.get("pp", 1)), bool(p.get("sp")), int(p.get("vpp", 1) or 1)
    mps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                  distributed_timeout_minutes=max(1, int(cfg.timeout_s // 60)))
    dp = mps.get_data_parallel_world_size()
    coords = {"tp": mps.get_tensor_model_parallel_rank(), "pp": mps.get_pipeline_model_parallel_rank(),
              "dp": mps.get_data_parallel_rank()}
    sizes = {"tp": tp, "pp": pp, "dp": dp}
    config = _config(spec, tp, pp, sp, vpp)
    bf16 = _bf16(spec)
    with megatron_shims.cpu_tensors_as_cuda():   # a tied output layer's copy is synced at its build
        chunks = [_build(spec, config, v if vpp > 1 else None) for v in range(vpp)]
        # bf16: Megatron-LM's get_model wraps each chunk in Float16Module (every parameter BF16, the
        # first stage's float inputs cast, the last stage's outputs back to FP32); ttrace traces the chunk
        wrapped = [Float16Module(config, c) if bf16 else c for c in chunks]
    if vpp == 1:
        model, rename = chunks[0], layer_renaming(chunks[0])
    else:   # a rank's chunks, traced as one model whose names drop the chunk index (the integration)
        model, rename = nn.ModuleList(chunks), chunks_renaming(chunks)
    if spec["model"].get("tie_embeddings"):   # the last stage's copy of the word embedding is that tensor
        rename = tied_renaming(rename)
    plan = plan_for(model)   # the integration (README)
    tracer.init_weights(model, plan, rename=rename, coords=coords, sizes=sizes)
    tensor_parallel_attrs(model, plan)
    zero1 = bool(p.get("zero1"))
    owned = _owned_layouts(model, plan) if zero1 else {}
    # bf16: FP32 main grads, reduced in FP32 (Megatron-LM sets --accumulate-allreduce-grads-in-fp32 for it)
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=zero1,
                                               bucket_size=None, grad_reduce_in_fp32=bf16)
    # one DDP per chunk, bucketing off after the first (as Megatron-LM's get_model sets it up)
    ddps = [DistributedDataParallel(config, ddp_config, c, disable_bucketing=v > 0)
            for v, c in enumerate(wrapped)]
    moves = perturbation_of(spec)   # fp32: weights moved one ulp (by attach); bf16: GEMM roundings drawn
    if tracer.role == "perturbed" and moves == "gemm":
        _draw_gemms(model, rename, tracer.perturb or 0, coords["dp"])
    tracer.attach(model, plan, rename=rename, coords=coords, sizes=sizes, perturb=moves == "weights",
                  meta={"pp_stage": coords["pp"], "perturbation": moves})
    m_local, mbs = cfg.micro_batches_local, cfg.micro_batch
    tracer.set_grad_scale(m_local / cfg.micro_batches_global)
    optimizer = _optimizer(ddps, cfg, zero1, bf16)
    adam, owners, shards = _adam_tensors(optimizer, model)
    tracer.load_optimizer_state(adam, model, plan, params=owners, shard=shards, rename=rename, coords=coords,
                                sizes=sizes)   # init.checkpoint's Adam state, when it holds one
    seq = cfg.model.seq_len
    mask = megatron_shims.causal_mask(seq)
    positions = torch.arange(seq)[None].expand(mbs, seq)
    forward_backward = get_forward_backward_func()
    last = mps.is_pipeline_last_stage()

    step_losses: list[float] = []
    scheduler = lr_schedule.Scheduler(cfg)
    for step in range(cfg.steps):
        batches = job.microbatches(step, coords["dp"], dp)
        losses: list[float] = []

        def forward_step(data_iterator, model_chunk, _losses=losses):  # noqa: ANN001
            mb = next(data_iterator)
            with tracer.microbatch(mb.index):
                out = model_chunk(mb.ids, positions, mask, labels=mb.labels)

            def loss_func(per_token: torch.Tensor, mb=mb):  # noqa: ANN001
                # per-token loss [b, s] from megatron's vocab-parallel cross-entropy
                tracer.record("loss", "output", per_token, Replicate(), microbatch=mb.index,
                              module_type="vocab_parallel_cross_entropy")
                loss = per_token.mean()
                tracer.record_loss(loss.detach(), microbatch=mb.index)
                _losses.append(loss.item())
                return loss, {"lm loss": loss.detach()}   # the schedule divides by m_local
            return out, loss_func

        with tracer.step(step):
            for ddp in ddps:
                ddp.zero_grad_buffer()
            optimizer.zero_grad(set_to_none=True)
            # interleaved (vpp): each chunk reads the step's microbatches in order from its own iterator
            data = iter(batches) if vpp == 1 else [iter(batches) for _ in chunks]
            with GpuBF16() if bf16 else contextlib.nullcontext():   # workloads/bf16_dispatch.py
                forward_backward(forward_step_func=forward_step, data_iterator=data, model=ddps,
                                 num_microbatches=m_local, seq_length=seq, micro_batch_size=mbs,
                                 forward_only=False)
            faults.maybe_inject(spec, job.rank, step)
            # DP all-reduce (zero1: reduce-scatter), SP LayerNorm grads over TP, embeddings
            finalize_model_grads(ddps)
            if zero1:
                grads = _owned_grads(optimizer, model, owned)
                tracer.record_param_grad_shards(grads)
                _owned_grads_back(model, grads)   # as grad-sign replay left them
            else:
                tracer.record_param_grads(model)
            scheduler.set(optimizer)
            with megatron_shims.cpu_tensors_as_cuda():
                optimizer.step()   # clips by the global grad norm; zero1: all-gathers the params
            scheduler.step(cfg.global_batch)
            tracer.record_params(model)
        if last:
            step_losses.append(job.mean_loss(losses, mps.get_data_parallel_group() if dp > 1 else None))
    tracer.save_checkpoint(model, adam, params=owners, rename=rename)   # checkpoint.save (reference)
    return step_losses


def _optimizer(ddps: list[Any], cfg: Any, zero1: bool, bf16: bool) -> Any:
    """megatron's optimizer for the model: Adam (torch's, where neither Transformer Engine nor apex is
    installed) with its global grad-norm clipping; with `zero1` its DistributedOptimizer; in bf16 its
    mixed-precision optimizer (FP32 main params, copied back to the BF16 parameters after each step)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(optimizer="adam", lr=cfg.lr, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
                             adam_eps=1e-8, clip_grad=cfg.clip_grad, bf16=bf16,
                             params_dtype=torch.bfloat16 if bf16 else torch.float32,
                             use_distributed_optimizer=zero1)
    with megatron_shims.cpu_tensors_as_cuda():
        return get_megatron_optimizer(config, ddps)


def _adam_tensors(optimizer: Any, model: nn.Module) -> tuple[torch.optim.Optimizer, list[Any], list[Any]]:
    """The torch optimizer inside megatron's, and per parameter (model.named_parameters() order) the tensor
    it steps and how to cut a parameter-shaped state tensor to it (tracer.Session.load_optimizer_state):
    the parameter itself, or under the distributed optimizer this rank's flat range of it (None where the
    rank owns none of it)."""
    (inner,) = optimizer.chained_optimizers   # one: no expert parameters
    adam = inner.optimizer
    named = list(model.named_parameters())
    if not hasattr(inner, "shard_fp32_groups"):
        # FP32Optimizer steps the parameters themselves, the bf16 one their FP32 main params
        owners, cuts = [getattr(q, "main_param", q) for _, q in named], [None] * len(named)
    else:
        # model params and the shards stepped: FP32 params' own, BF16 params' FP32 main copies
        pairs = [*zip(inner.model_fp32_groups, inner.shard_fp32_groups, strict=True),
                 *zip(inner.model_float16_groups, inner.shard_fp32_from_float16_groups, strict=True)]
        shard_of = {id(m): s for mg, sg in pairs for m, s in zip(mg, sg, strict=True)}
        owners, cuts = [], []
        for _, q in named:
            owners.append(shard_of.get(id(q)))
            r = _owned_range(inner, q)
            cuts.append(None if r is None else (lambda t, r=r: t.reshape(-1)[r.start:r.end]))
    # Adam's state is keyed by the tensors it steps: a state loaded for another would be ignored, silently
    stepped = {id(t) for g in adam.param_groups for t in g["params"]}
    lost = [n for (n, _), o in zip(named, owners, strict=True) if o is not None and id(o) not in stepped]
    if lost:
        raise RuntimeError(f"megatron-core's optimizer does not step the tensors found for {lost[:3]}: "
                           "its Adam state would not load there (megatron-core's optimizer layout changed?)")
    return adam, owners, cuts


def _owned_range(inner: Any, param: torch.nn.Parameter) -> Any:
    """The flat range of `param` this rank's DistributedOptimizer owns (megatron's Range), or None."""
    return inner._get_model_param_range_map(param)["param"] if param in inner.model_param_gbuf_map else None


def _owned_layouts(model: nn.Module, plan: dict[str, Any]) -> dict[str, Layout]:
    """Each parameter's layout as the distributed optimizer's grad ranges record it (`_owned_grads`): the
    plan's, a disjoint partial sum over dp besides. Made once per job."""
    return {name: Layout(lay.shard, (*lay.partial, "dp"), lay.zigzag, ("dp",))
            for name, lay in param_layouts(model, plan).items()}


def _owned_grads(optimizer: Any, model: nn.Module,
                 layouts: dict[str, Layout]) -> dict[str, tuple[torch.Tensor, Layout, torch.Tensor]]:
    """Each parameter's grad as the distributed optimizer holds it after the reduce-scatter (module doc):
    the reduced elements of the ranges this rank owns, zeros elsewhere, a partial sum over dp (`layouts`:
    `_owned_layouts`), and the mask of those elements (Session.record_param_grad_shards)."""
    (inner,) = optimizer.chained_optimizers
    out = {}
    for name, q in model.named_parameters():
        if not q.requires_grad:   # frozen: no grad buffer, no record (as record_param_grads)
            continue
        grad = torch.zeros_like(q.main_grad)
        owned = torch.zeros(q.main_grad.shape, dtype=torch.bool)
        r = _owned_range(inner, q)
        if r is not None:
            grad.view(-1)[r.start:r.end] = q.main_grad.view(-1)[r.start:r.end]
            owned.view(-1)[r.start:r.end] = True
        out[name] = (grad, layouts[name], owned)
    return out


def _owned_grads_back(model: nn.Module, grads: dict[str, tuple[torch.Tensor, Layout, torch.Tensor]]) -> None:
    """The owned elements of `grads` (`_owned_grads`' copies, recorded) written back into the grad buffer
    the distributed optimizer reads: grad-sign replay (tracer/grad_signs.py) edits the recorded tensors.
    Without it, a zero1 candidate stepped its own signs (a clean megatron-core bf16 tp2_dp2 zero1 check
    failed at 22 of the word embedding's 868 near-zero-grad elements, which no perturbed run moved)."""
    params = dict(model.named_parameters())
    for name, (grad, _, owned) in grads.items():
        params[name].main_grad[owned] = grad[owned]


def tensor_parallel_attrs(model: nn.Module, plan: dict[str, Any]) -> None:
    """Set megatron's `tensor_model_parallel` / `partition_dim` param attributes from the plan (they
    are only set by megatron's own weight init, which a consistently initialized model skips); its
    grad-norm (`param_is_not_tensor_parallel_duplicate`) reads them."""
    layouts = param_layouts(model, plan)
    for name, p in model.named_parameters():
        shard = layouts[name].shard
        p.tensor_model_parallel = bool(shard)
        p.partition_dim = shard[0][0] if shard else -1
        p.partition_stride = 1


def _bf16(spec: Mapping[str, Any]) -> bool:
    return (spec.get("precision") or {}).get("name", "fp32") == "bf16"


def _draw_gemms(model: nn.Module, rename: Any, run: int, stream: int) -> None:
    """A bf16 perturbed reference: every megatron linear layer's GEMM result (forward output, input grad)
    drawn again at its rounding, keyed by the layer's global name (workloads/rounding_draws.py)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for name, m in model.named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            draw = module_draw(run, rename(name) if rename else name, stream, "bf16")
            m.register_forward_pre_hook(lambda _, args, d=draw: (grad_drawn(args[0], d), *args[1:]))
            m.register_forward_hook(lambda _, args, out, d=draw: (drawn(out[0], d), *out[1:]))
