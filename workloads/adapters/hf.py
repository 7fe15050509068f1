"""job=hf: a tiny randomly initialized Hugging Face `LlamaForCausalLM` under transformers' own
tensor parallelism (`from_pretrained(..., distributed_config=DistributedConfig(tp_size=tp))`), or under
torch's DistributedDataParallel (dp > 1, what the Trainer's accelerate wraps it in under torchrun),
against the same model loaded in one process.

Weights: every parameter is generated as its full logical tensor by its Hugging Face name
(`tr.init_weights`, the consistent generator) and saved as a checkpoint in a private temp directory;
reference and candidate both load it with `from_pretrained`, transformers shards it (each TP rank
keeps its DTensor shard), so every run starts from the same logical weights; the session perturbs
the loaded shards (perturbed role) when it attaches.

KV heads must shard over TP (kv_heads % tp == 0; `job=hf` defaults to model=llama_tiny_kv2):
transformers refuses to split one KV head over ranks, and none of its TP styles is right for a
replicated K/V projection fed by a replicated input. Its `replicated_with_grad_allreduce` style sums
the weight grads but not the input grads (measured: the step-1 loss moves by 5e-5 at tp=2 with one
KV head); that plan is the injected bug `hf_gqa_kv_replicated_plan`.

Precision (`precision=fp32|bf16`): bf16 runs the forward under `torch.autocast`, as Hugging Face's
Trainer does with `bf16=True` (FP32 parameters, grads and Adam; Linear layers and attention in BF16,
the rest as the model's code casts it). Perturbed references draw every Linear's rounding
(`draw_gemms`). Not calibrated: docs/tolerance.md "Known gaps".

Tracing: `tracer.integrations.dtensor.DTensorTracer` (param layouts from DTensor placements) with
`tracer.integrations.hf.tp_local_layouts` for the outputs transformers hands out as plain local
tensors (read from the TP styles' own output placements).
"""

from __future__ import annotations

import shutil
import tempfile
import types
from typing import Any

import torch
import torch.nn.functional as F

from tracer import ConfigError
from tracer.job import Session
from workloads import bugs, harness
from workloads.adapters.torch_native import train
from workloads.config import Config, parse, pp_schedule_refused, recompute_refused
from workloads.precision import perturbation_of, weights_refused
from workloads.rounding_draws import module_draw, perturbed_linear

KV_REPLICATED = "replicated_with_grad_allreduce"
PRECISIONS = ("fp32", "bf16")
AUTOCAST = {"bf16": torch.bfloat16}   # the forward's torch.autocast dtype (fp32: none)


def rank_imports() -> None:
    """What every rank imports, for the fork server to import once before forking them
    (orchestrator/fork_server.py rank_imports): transformers' Llama model and its loading, 2-3 s of CPU.
    Not at this module's import, which the driver's recipe validation pays."""
    import transformers.distributed  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    import tracer.integrations.dtensor  # noqa: F401
    import tracer.integrations.hf  # noqa: F401


def llama_config(cfg: Config) -> Any:
    from transformers import LlamaConfig

    m = cfg.model
    return LlamaConfig(vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.ffn_hidden,
                       num_hidden_layers=m.layers, num_attention_heads=m.heads,
                       num_key_value_heads=m.num_kv_heads, max_position_embeddings=m.seq_len,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=m.tie_embeddings,
                       attention_bias=False, mlp_bias=False, use_cache=False)


def write_checkpoint(cfg: Config, tr: Session, directory: str) -> None:
    """The full logical weights from the consistent generator, saved as a Hugging Face checkpoint."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config(cfg))
    tr.init_weights(model, coords={}, sizes={})   # a tied lm_head is listed once (embed_tokens)
    model.save_pretrained(directory)   # before the process group exists: transformers saves on rank 0 only


def tp_plan(cfg: Config) -> dict[str, str] | None:
    """Overrides of the model's own TP plan (None: transformers' `base_model_tp_plan` as is)."""
    if bugs.active(cfg.bug, "hf_gqa_kv_replicated_plan"):
        # BUG hf_gqa_kv_replicated_plan: fewer KV heads than TP ranks, so the plan replicates k_proj/v_proj
        # with transformers' "replicated_with_grad_allreduce" style. Their weight grads are summed over
        # TP, but their input grads (each rank: its own query heads' part) are not: the grad reaching
        # input_layernorm differs across TP ranks.
        return {f"model.layers.*.self_attn.{proj}": KV_REPLICATED for proj in ("k_proj", "v_proj")}
    return None


def load(cfg: Config, directory: str) -> Any:
    from transformers import LlamaForCausalLM

    kw: dict[str, Any] = {"attn_implementation": "sdpa", "dtype": torch.float32}
    if cfg.parallel.tp > 1:
        from transformers.distributed import DistributedConfig

        kw["distributed_config"] = DistributedConfig(tp_size=cfg.parallel.tp, tp_plan=tp_plan(cfg))
    model = LlamaForCausalLM.from_pretrained(directory, **kw)
    if cfg.parallel.recompute == "full":   # transformers' own switch, as a user flips it (its defaults)
        model.activation_checkpointing_enable()
    model.train()
    return model


def draw_gemms(model: Any, run: int) -> None:
    """A bf16 perturbed reference: every nn.Linear's GEMM result (forward output, input grad) drawn
    again at its BF16 rounding (workloads/rounding_draws.py), under autocast as the candidate runs it.
    An input grad reaches the draw as FP32 (autocast's cast of an FP32 input), holding BF16 values: it
    is drawn in BF16."""
    from torch import nn

    for name, m in model.named_modules():   # one device: validate refuses a sharded bf16 reference
        if isinstance(m, nn.Linear):
            draw = module_draw(run, name, 0, "bf16")
            gemm = perturbed_linear(F.linear, lambda t, d=draw: d(t.to(torch.bfloat16)).to(t.dtype))
            m.forward = types.MethodType(lambda self, x, g=gemm: g(x, self.weight, self.bias), m)


# -- adapter contract ------------------------------------------------------------------------------
def validate(spec: dict) -> None:
    cfg = parse(spec)
    m, p = cfg.model, cfg.parallel
    where = f"job=hf, parallel={p.name}, model={m.name}"

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(f"{where}: {msg}")

    need(m.arch == "llama", "the Hugging Face recipe builds a LlamaForCausalLM; use model=llama_tiny")
    need(p.world_size == p.tp * p.dp and (p.tp == 1 or p.dp == 1) and p.pp == 1 and p.cp == 1
         and p.vpp == 1 and p.ep == 1 and not p.zero1 and not p.sp,
         "the Hugging Face job runs transformers' own tensor parallelism or torch DDP data parallelism, "
         "one at a time (parallel=single, tp2 or dp2; transformers' sequence parallelism is not "
         "implemented upstream)")
    need(cfg.precision in PRECISIONS, f"precision={cfg.precision}: the Hugging Face recipe runs "
         f"{' or '.join(PRECISIONS)}")
    need((why := weights_refused(spec)) is None, str(why))
    role = (spec.get("trace") or {}).get("role")
    need(not (cfg.precision == "bf16" and role in ("reference", "perturbed") and p.tp > 1),
         "precision=bf16: the perturbed references' GEMM draws on sharded weights (draw_gemms) are not "
         "wired; run the reference on one device (reference.parallel=null)")
    need(m.heads % p.tp == 0 and m.ffn_hidden % p.tp == 0 and m.vocab % p.tp == 0,
         f"heads, ffn_hidden and vocab must be divisible by tp={p.tp}")
    kv_bug = cfg.bug == "hf_gqa_kv_replicated_plan" and p.tp % m.num_kv_heads == 0
    need(m.num_kv_heads % p.tp == 0 or kv_bug,
         f"kv_heads={m.num_kv_heads} is not divisible by tp={p.tp}: transformers cannot split a KV head "
         "and has no correct style for replicated K/V projections; use model=llama_tiny_kv2 "
         "(the job=hf default)")
    need(cfg.global_batch % (p.dp * cfg.micro_batch) == 0,
         f"data.global_batch={cfg.global_batch} must be divisible by dp*micro_batch={p.dp}*{cfg.micro_batch}")
    ours = sorted(n for n, b in bugs.CATALOG.items() if b.job == "hf")
    need(cfg.bug == bugs.NONE or cfg.bug in ours,
         f"bug={cfg.bug} is not a Hugging Face bug; known: {', '.join(ours) or '-'} (or 'none')")
    need(cfg.steps >= 1, "steps must be >= 1")
    need((why := recompute_refused(p.recompute, selective=False)) is None, str(why))
    need((why := pp_schedule_refused(p.pp_schedule)) is None, str(why))


def main(session: Session | None = None) -> dict[str, Any]:
    """One rank of the Hugging Face job (an entrypoint of the job contract)."""
    from tracer.integrations.hf import tp_local_layouts

    with harness.rank_job(validate, session, process_group=False) as job:
        cfg, tr = job.cfg, job.session
        directory = tempfile.mkdtemp(prefix="ttrace-hf-")   # this rank's private copy of the checkpoint
        try:
            write_checkpoint(cfg, tr, directory)
            job.init_process_group()           # transformers reads torchrun's variables for its mesh
            model = load(cfg, directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        moves = perturbation_of(job.spec)
        if tr.role == "perturbed" and moves == "gemm":
            draw_gemms(model, tr.perturb)
        layouts, mesh = tp_local_layouts(model), getattr(model, "_device_mesh", None)
        dp = cfg.parallel.dp
        if dp > 1:   # what the Trainer's accelerate does under torchrun: the loaded model in torch DDP
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model)   # attached as it is: the wrapper is in no name
        tr.attach(model, mesh=mesh, local_layouts=layouts, perturb=moves == "weights",
                  meta={"perturbation": moves})
        rank = job.rank if dp > 1 else 0
        return {"losses": train(model, job, rank, dp, torch.distributed.group.WORLD if dp > 1 else None,
                                autocast=AUTOCAST.get(cfg.precision))}
