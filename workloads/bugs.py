"""Catalog of injectable silent bugs carried by this workload (names are the BUGS.md contract).

Each switch is off by default and is checked with `active(spec, name)` at the one place the real
code had the mistake; it changes numerics only (no crash, no hang).
"""

from __future__ import annotations

import re
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
    # Regression suite (orchestrator/nightly.py, bench/bugs.py): the recipe overrides that trigger the
    # bug, and an fnmatch pattern the culprit's (else the first divergence's) "module/kind" must match.
    trigger: tuple[str, ...] = ()
    expect: str = ""
    job: str = "builtin"         # the job option carrying it (job=<name>; workloads/adapters: bugs
                                 # injected into a third-party library)
    # The reference runs the candidate's code, bug included. A bug a single device shares needs a
    # reference that differs where the bug lives: these overrides (recipe `reference.*`) give it.
    reference: tuple[str, ...] = ()
    source: str = ""             # where the real bug was reported
    # Late bugs (issue 18) stay silent until a step the recipe sets. `late` puts that step where a real
    # run meets it (`first_step`): only a scan over many steps finds it there. `early` moves it to step 1,
    # so a 2-step check (nightly, bench-bugs: `recipe`) runs it as an ordinary check.
    late: tuple[str, ...] = ()
    early: tuple[str, ...] = ()
    first_step: int = 0          # the step it first acts at under `late` (0: from the first step)
    # The honest counterpart's overrides (bench/bugs.py) where the trigger's setting is refused without
    # the bug (no honest plan exists there); default: the trigger itself.
    clean: tuple[str, ...] = ()

    @property
    def is_late(self) -> bool:
        return self.first_step > 0

    @property
    def triggered(self) -> tuple[str, ...]:
        """The candidate's overrides that make it act within a 2-step check: its trigger (late: at step 1)."""
        return (*self.trigger, *self.early)

    @property
    def recipe(self) -> tuple[str, ...]:
        """The overrides of a check that must catch it: its trigger, and the reference it needs."""
        return (*self.triggered, *self.reference)

    @property
    def clean_recipe(self) -> tuple[str, ...]:
        """The overrides of its honest counterpart (bench/bugs.py): `clean`, else its trigger."""
        return (*(self.clean or self.triggered), *self.reference)

    @property
    def scan_recipe(self) -> tuple[str, ...]:
        """The overrides of a run that meets it at its real step, `first_step` (late bugs)."""
        return (*self.trigger, *self.late, *self.reference)


NONE = "none"

CATALOG: dict[str, Bug] = {b.name: b for b in (
    Bug("dp_grad_not_averaged",
        "data-parallel grads are all-reduced (summed) but never divided by the DP size",
        12, "dp>1", "every param_grad (x dp); first: embedding.word.weight. Adam hides it in loss/params",
        trigger=('parallel=tp2_dp2',), expect='embedding.word/param_grad',
        source='BUGS.md #12 (data-parallel averaging)'),
    Bug("sp_layernorm_grad_unreduced",
        "with TP+SP, LayerNorm weight/bias grads are not all-reduced over the TP group",
        1, "tp>1, sp", "layers.*.ln1/ln2 and final_ln weight/bias grads (param_grad; replicas disagree)",
        trigger=('parallel=tp2_sp',), expect='layers.0.ln1/param_grad',
        source='https://github.com/NVIDIA/Megatron-LM/issues/1446'),
    Bug("row_parallel_bias_per_rank",
        "RowParallelLinear adds its bias to the partial output on every TP rank before the reduction",
        15, "tp>1", "layers.0.attn.proj output at step 1 (biases start at zero: step 0 is exact)",
        trigger=('parallel=tp2',), expect='layers.0.attn.proj/output',
        source='BUGS.md #15'),
    Bug("fp8_amax_unreduced",
        "FP8 amax not reduced (MAX) across the TP group: each shard quantizes with its own scale",
        14, "tp>1, precision=fp8", 
        "layers.0.attn.qkv output, step 0 (its weight shards get their own scales)",
        trigger=('parallel=tp2', 'precision=fp8'), expect='layers.0.attn.qkv/output',
        source='BUGS.md #14 (TransformerEngine amax reduction)'),
)}

# Issue 4: GQA, tied embeddings, gradient accumulation, ZeRO-1 (workloads/llama.py, grad_sync.py, zero.py).
CATALOG.update({b.name: b for b in (
    Bug("grad_accum_not_scaled",
        "with several microbatches per step the loss is not divided by the number of local microbatches "
        "before backward, so accumulated grads are that many times too large",
        17, "micro-batches per DP rank > 1 (any recipe, one device too; trigger: parallel=tp2)",
        "every param_grad at step 0 is (local microbatches) times too large: the first one recorded, "
        "embedding.word's, is the honest answer (a reference without accumulation has no microbatch "
        "tensors to compare)",
        trigger=('parallel=tp2',), expect='embedding.word/param_grad',
        reference=("reference.micro_batch=${data.global_batch}",),   # one microbatch: no accumulation
        source='BUGS.md #17'),
    Bug("kv_head_grad_unreduced",
        "GQA with fewer KV heads than TP ranks: the replicated KV projection's grads are not all-reduced "
        "over the TP ranks sharing the KV head",
        11, "model=llama_tiny (kv_heads=1), tp>1 (trigger: parallel=tp2)",
        "layers.*.attn.kv weight param_grad at step 0 (its TP replicas disagree)",
        trigger=('model=llama_tiny', 'parallel=tp2'), expect='layers.0.attn.kv/param_grad',
        source='https://github.com/bigcode-project/Megatron-LM/issues/11'),
    Bug("attention_dq_scale_wrong",
        "the explicit-backward GQA attention path computes dQ without the 1/sqrt(d) softmax scale",
        4, "model=llama_tiny (its attention code path), any layout (trigger: parallel=tp2)",
        "layers.3.attn.q grad_output (step 0, first microbatch): the last layer's dQ, first in backward",
        trigger=('model=llama_tiny', 'parallel=tp2'), expect='layers.3.attn.q/grad_output',
        reference=("reference.attention=autograd",),   # the same attention, autograd's backward
        source='https://github.com/NVIDIA/TransformerEngine/issues/1615'),
    Bug("tied_embedding_grad_lost_pp",
        "tied input/output embedding: the word-embedding grads of the first and last pipeline stage "
        "are not summed over the embedding group",
        6, "model=llama_tiny (tie_embeddings), pp>1 (trigger: parallel=pp2)",
        "embedding.word.weight param_grad at step 0 (first/last stage copies disagree)",
        trigger=('model=llama_tiny', 'parallel=pp2'), expect='embedding.word/param_grad',
        source='https://github.com/NVIDIA/Megatron-LM/issues/1548'),
    Bug("tied_embedding_grad_distopt",
        "with the distributed optimizer the tied-embedding all-reduce runs on the full grad buffer after "
        "the optimizer took its shards, so the shards miss the other stage's contribution",
        5, "model=llama_tiny (tie_embeddings), pp>1, zero1 (trigger: parallel=pp2_dp2_zero1)",
        "embedding.word.weight param_grad at step 0 (ZeRO shards; stage copies disagree)",
        trigger=('model=llama_tiny', 'parallel=pp2_dp2_zero1'), expect='embedding.word/param_grad',
        source='https://github.com/NVIDIA/Megatron-LM/issues/844'),
    Bug("zero1_gather_offset_wrong",
        "the distributed optimizer all-gathers the updated parameter shards to the wrong offsets",
        18, "zero1, dp>1 (trigger: parallel=dp2_zero1)",
        "the first parameter after the step 0 update (param kind): embedding.word.weight",
        trigger=('model=llama_tiny', 'parallel=dp2_zero1'), expect='embedding.word/param',
        source='BUGS.md #18'),
    Bug("vpp_layer_offset_wrong",
        "a virtual-pipeline chunk computes its global layer numbers with the non-interleaved formula, "
        "so it initializes (and is traced as) the wrong layers",
        13, "pp>1, vpp>1 (trigger: parallel=pp2_vpp2)",
        "layers.1 (its first submodule output, layers.1.ln1 / norm1) at step 0: the first misplaced chunk",
        trigger=('model=llama_tiny', 'parallel=pp2_vpp2'), expect='layers.1.norm1/output',
        source='BUGS.md #13'),
    Bug("cp_loss_scaling_wrong",
        "under context parallelism each CP rank's copy of the loss is backpropagated as if the CP ranks' "
        "losses were summed: every grad is cp times too large",
        10, "cp>1 (trigger: parallel=cp2)",
        "head grad_output (step 0, first microbatch): the first tensor behind the loss gather",
        trigger=('model=llama_tiny', 'parallel=cp2'), expect='head/grad_output',
        source='https://github.com/NVIDIA/Megatron-LM/issues/673'),
    Bug("cp_rope_offset_wrong",
        "rotary position ids are not offset for the local (zigzag) sequence chunks under CP",
        16, "model=llama_tiny, cp>1 (trigger: parallel=cp2)",
        "layers.0.attn.core output (step 0): the first attention computed with wrong rotary positions",
        trigger=('model=llama_tiny', 'parallel=cp2'), expect='layers.0.attn.core/output',
        source='BUGS.md #16'),
    Bug("cp_attention_backward_wrong",
        "ring attention backward: a received dK/dV partial replaces the owner's accumulator instead of "
        "being added to it",
        3, "cp>1 (trigger: parallel=cp2)",
        "the last layer's qkv (gpt) / kv (llama) grad_output at step 0: the first dK/dV after the ring",
        trigger=('model=llama_tiny', 'parallel=cp2'), expect='layers.3.attn.kv/grad_output',
        source='https://github.com/NVIDIA/Megatron-LM/issues/1464'),
    Bug("expert_grad_scaling_wrong",
        "MoE expert grads are divided by the expert-data-parallel size instead of the data-parallel size",
        9, "model=moe_tiny, ep>1 (trigger: parallel=ep2)",
        "every expert weight param_grad at step 0 is off by the same factor: the first one recorded "
        "(layers.0.mlp.experts.0.gate) is the honest answer",
        trigger=('model=moe_tiny', 'parallel=ep2'), expect='layers.0.mlp.experts.0.gate/param_grad',
        source='https://github.com/NVIDIA/Megatron-LM/pull/7165'),
    Bug("expert_tp_grad_wrong_group",
        "expert-tensor-parallel grads are all-reduced over the TP group instead of the expert-data-parallel "
        "group (ETP>1, EP=1)",
        7, "model=moe_tiny, tp>1, ep=1, dp>1 (trigger: parallel=tp2_dp2)",
        "every expert weight param_grad at step 0 is reduced over the wrong group: the first one "
        "recorded (layers.0.mlp.experts.0.gate) is the honest answer",
        trigger=('model=moe_tiny', 'parallel=tp2_dp2'), expect='layers.0.mlp.experts.0.gate/param_grad',
        source='https://github.com/NVIDIA/Megatron-LM/issues/1628'),
    Bug("grad_norm_wrong_group",
        "the global grad norm for clipping reduces the expert part over the wrong group (EDP, not EP), "
        "so EP ranks clip with different coefficients",
        8, "model=moe_tiny, ep>1, clipping active (trigger: parallel=ep2_tp2)",
        "params after the step 0 update: every parameter on the EP ranks is clipped by a wrong "
        "coefficient, so the first one recorded (embedding.word) is the honest answer. In fp32, which "
        "the trigger runs; in bf16 a clip coefficient moves Adam's first update only where |g| is near "
        "eps, and the first param to show it is layers.0.attn.q (its EP replicas differ)",
        trigger=('model=moe_tiny', 'parallel=ep2_tp2'), expect='embedding.word/param',
        source='https://github.com/NVIDIA/Megatron-LM/pull/5916'),
    Bug("moe_router_grad_unreduced",
        "with TP+SP the MoE router weight lacks the sequence-parallel marking, so its grad (partial over "
        "the TP ranks' sequence chunks) is never all-reduced",
        2, "model=moe_tiny, tp>1, sp (trigger: parallel=ep2_tp2)",
        "layers.0.mlp.router weight param_grad at step 0 (its TP replicas disagree)",
        trigger=('model=moe_tiny', 'parallel=ep2_tp2'), expect='layers.0.mlp.router/param_grad',
        source='https://github.com/NVIDIA/Megatron-LM/issues/599'),
)})


# Issue 18: late bugs, silent for their first steps (their `early` recipe makes a 2-step check meet them).
CATALOG.update({b.name: b for b in (
    Bug("late_grad_bucket_stale",
        "from step bug.from_step one data-parallel grad bucket (bucket 1) all-reduces the buffer it was "
        "filled with at the previous step, as after a re-bucketing whose bucket views still point at the "
        "old buffer: its params step with the previous step's grads (workloads/grad_sync.py DPGradBuckets)",
        0, "dp>1 (trigger: parallel=tp2_dp2); acts from step bug.from_step (default 100)",
        "layers.3.mlp.fc1 param_grad at step bug.from_step: with gpt_tiny under tp2, DP bucket 1 (buckets "
        "of BUCKET_CAP=8192 elements in reverse registration order, as DDP fills them) holds exactly the "
        "last layer's fc1 weight and bias",
        trigger=("parallel=tp2_dp2",), expect="layers.3.mlp.fc1/param_grad",
        early=("bug.from_step=1",), late=("bug.from_step=100",), first_step=100,
        source="https://github.com/pytorch/pytorch/pull/43307 (DDP: after the bucket views were "
               "re-initialized, grads were no longer copied into the all-reduced bucket contents; wrong "
               "only from the second iteration on); stale grad buffer: "
               "https://github.com/NVIDIA/Megatron-LM/pull/4609"),
    Bug("lr_schedule_local_samples",
        "the LR scheduler is advanced by this rank's samples (micro_batch x local microbatches) instead of "
        "the global batch, so under DP the decay begins dp times late: the LR is right until the decay "
        "boundary optim.lr_decay_from, then stays undecayed",
        0, "dp>1 and an LR decay, optim.lr_decay_from (trigger: parallel=tp2_dp2)",
        "params after the update of step optim.lr_decay_from (param kind): every parameter steps with the "
        "undecayed LR, so the first one recorded (embedding.word) is the honest answer",
        trigger=("parallel=tp2_dp2",), expect="embedding.word/param",
        early=("optim.lr_decay_from=1",), late=("optim.lr_decay_from=100",), first_step=100,
        source="https://github.com/huggingface/diffusers/pull/8312 (the LR decayed num_processes times "
               "slower than expected); Megatron-LM train_step steps its scheduler by "
               "num_microbatches x micro_batch_size x data_parallel_size samples"),
)})


# Bugs injected into third-party frameworks by patching the real function at fault
# (workloads/adapters/<job>.py); their `trigger` includes the `job=` option.
# -- megatron-core
CATALOG.update({b.name: b for b in (
    Bug("megatron_sp_layernorm_grad_unreduced",
        "megatron-core finalize_model_grads: _allreduce_non_tensor_model_parallel_grads loses its "
        "sequence-parallel branch, so LayerNorm grads (partial over each rank's sequence chunk) are "
        "never all-reduced over TP",
        0, "tp>1, sp (trigger: job=megatron_core parallel=tp2_sp)",
        "decoder.layers.0.input_layernorm weight param_grad at step 0 (its TP replicas disagree)",
        trigger=("job=megatron_core", "parallel=tp2_sp"),
        expect="decoder.layers.0.input_layernorm/param_grad", job="megatron_core"),
    Bug("megatron_sp_allgather_grad_unreduced",
        "megatron-core ColumnParallelLinear under SP: the backward of its input all-gather scatters the "
        "input grad instead of reduce-scattering it (tensor_parallel/layers.py dist_reduce_scatter_func), "
        "so each rank keeps only its own heads'/features' share of the grad",
        0, "tp>1, sp (trigger: job=megatron_core parallel=tp2_sp)",
        "decoder.final_layernorm grad_output at step 0 (the output layer's input grad: first in backward)",
        trigger=("job=megatron_core", "parallel=tp2_sp"), expect="decoder.final_layernorm/grad_output",
        job="megatron_core"),
    Bug("megatron_zero1_gather_offset_wrong",
        "megatron-core DistributedOptimizer: the all-gather of the updated parameter shards "
        "(_ParamAndGradBucketGroup.start_param_sync) lands shard i at offset i-1 of the param buffer",
        18, "zero1, dp>1 (trigger: job=megatron_core parallel=dp2_zero1)",
        "the first parameter after the step 0 update (param kind): embedding.word_embeddings.weight",
        trigger=("job=megatron_core", "parallel=dp2_zero1"), expect="embedding.word_embeddings/param",
        job="megatron_core", source="BUGS.md #18, in megatron-core's own distributed optimizer"),
    Bug("megatron_tied_embedding_grad_lost_pp",
        "megatron-core finalize_model_grads with tied input/output embeddings over pp stages: "
        "_allreduce_word_embedding_grads is lost, so the first stage's word embedding and the last "
        "stage's copy (its output layer's weight) are never given each other's grads",
        6, "tie_embeddings, pp>1 (trigger: job=megatron_core parallel=pp2 ++model.tie_embeddings=true)",
        "embedding.word_embeddings weight param_grad at step 0 (the two stages' copies disagree)",
        trigger=("job=megatron_core", "parallel=pp2", "++model.tie_embeddings=true"),
        expect="embedding.word_embeddings/param_grad", job="megatron_core",
        source="https://github.com/NVIDIA/Megatron-LM/issues/1548, in megatron-core's own grad finalization"),
    Bug("megatron_vpp_layer_offset_wrong",
        "megatron-core get_transformer_layer_offset under virtual pipelining: a chunk's first layer by the "
        "non-interleaved formula, so a rank's chunks hold consecutive layers (pp=2, vpp=2: rank 0 builds "
        "layers 0 and 1, not 0 and 2) and each is initialized and traced as the wrong layer",
        13, "pp>1, vpp>1 (trigger: job=megatron_core parallel=pp2_vpp2)",
        "decoder.layers.1 (its input layernorm) at step 0: the first layer run out of place",
        trigger=("job=megatron_core", "parallel=pp2_vpp2"), expect="decoder.layers.1.input_layernorm/output",
        job="megatron_core", source="BUGS.md #13, in megatron-core's own layer numbering"),
    Bug("megatron_vpp_pp2_p2p_crossed",
        "megatron-core's interleaved schedule at pp=2 with batched p2p (its default batch_p2p_comm): a "
        "rank's next and previous stage are one peer, and the activation and grad sent to it in one batch "
        "pair first-in first-out with receives posted in the other order, so they cross",
        0, "pp=2, vpp>1 (trigger: job=megatron_core parallel=pp2_vpp2)",
        "decoder.layers.1 grad_output at step 0 (a later microbatch's tensors crossed)",
        trigger=("job=megatron_core", "parallel=pp2_vpp2"), expect="decoder.layers.1/grad_output",
        job="megatron_core",
        source="https://github.com/NVIDIA/Megatron-LM/issues/750 (also #1450, PR #5271)"),
)})
# -- PyTorch-native (DTensor plans, FSDP2, pipelining)
CATALOG.update({b.name: b for b in (
    Bug("tn_gqa_kv_gathered_output",
        "torch-native TP plan for GQA with fewer KV heads than TP ranks: wk/wv as "
        "`ColwiseParallel(output_layouts=Replicate())` (shard, then gather K/V). The forward is right, but "
        "`to_local()` declares each rank's K/V gradient replicated although it only covers that rank's "
        "query heads, so the wk/wv grads and their input grad lose the other ranks' part",
        0, "job=torch_native, model=llama_tiny (kv_heads=1), tp>1 (trigger: parallel=tp2)",
        "the last layer's attention.wk or attention.wv grad_output at step 0 (first backward tensor "
        "of the K/V projections)",
        job="torch_native", trigger=("job=torch_native", "parallel=tp2"),
        expect="layers.3.attention.wv/grad_output"),
    Bug("tn_pp_grad_norm_stage_local",
        "torch-native pipelining: gradient clipping computes the global norm from each stage's own "
        "parameters (torch's clip_grad_norm_ knows the DTensor placements, which say nothing of pp), so "
        "each stage clips by its own coefficient",
        8, "job=torch_native, pp>1, clipping active (trigger: parallel=pp2)",
        "params after the step 0 update: every stage applied a wrong clip coefficient",
        job="torch_native", trigger=("job=torch_native", "parallel=pp2", "++model.tie_embeddings=false"),
        expect="*/param", source="https://github.com/pytorch/torchtitan/issues/596 (fixed by PR #649)"),
    Bug("tn_pp_zero_bubble_fsdp2_grads",
        "torch 2.13's zero-bubble pipelining with FSDP2 wrapped per block (torchtitan's way): the split "
        "backward's weight passes and the blocks' FSDP2 units leave every stage but the first with wrong "
        "weight grads (50-94% off) and the last stage with none, so Adam skips it. The bug is torch's; the "
        "switch keeps torchtitan's per-block wrapping where the job wraps each stage whole under a "
        "zero-bubble schedule (torch_pipeline.fsdp_per_block)",
        12, "job=torch_native, a zero-bubble schedule, dp>1 (trigger: parallel=pp2_vpp2, world_size=4)",
        "the second stage's first param_grad at step 0 (layers.1); the last stage's param grads are "
        "missing (a FAIL each: never trained)",
        job="torch_native", trigger=("job=torch_native", "parallel=pp2_vpp2", "parallel.world_size=4",
                                     "parallel.pp_schedule=InterleavedZeroBubble",
                                     "++model.tie_embeddings=false"),
        expect="layers.1.*/param_grad",
        source="found by ttrace in torch 2.13, no upstream report found (scripts/repro_zb_fsdp_grads.py; "
               "nearest: pytorch PR #134052, FSDP with zero-bubble pp needing a manual post-backward hook)"),
)})
# -- Hugging Face transformers
CATALOG.update({b.name: b for b in (
    Bug("hf_gqa_kv_replicated_plan",
        "Hugging Face TP plan for GQA with fewer KV heads than TP ranks maps k_proj/v_proj to transformers' "
        "\"replicated_with_grad_allreduce\" style: their weight grads are summed over TP, but their input "
        "grads (each rank: its own query heads' part) are not, so the gradient reaching the attention "
        "input differs across TP ranks",
        0, "job=hf, model=llama_tiny (kv_heads=1), tp>1 (trigger: parallel=tp2)",
        "the last layer's input_layernorm grad_output at step 0: the K/V projections' input gradient, "
        "whose TP replicas disagree",
        job="hf", trigger=("job=hf", "model=llama_tiny", "parallel=tp2"),
        expect="model.layers.3.input_layernorm/grad_output",
        # transformers cannot split llama_tiny's one KV head over tp=2: the same job on two KV heads
        clean=("job=hf", "model=llama_tiny_kv2", "parallel=tp2")),
    Bug("hf_ddp_grads_never_synced",
        "Hugging Face model under torch DDP with gradient accumulation: every microbatch's backward runs "
        "inside `no_sync()`, the last one included, so the grads are never all-reduced and each DP rank "
        "steps on its own microbatches' grads (DDP's documented pattern runs the last backward outside "
        "it; accelerate syncs on the last step of its dataloader only)",
        12, "job=hf, dp>1, microbatches per DP rank > 1 (trigger: parallel=dp2)",
        "the first param grad at step 0: its DP replicas disagree",
        job="hf", trigger=("job=hf", "parallel=dp2"), expect="*/param_grad",
        source="https://github.com/pytorch/pytorch/issues/53443 (also huggingface/accelerate#1847)"),
)})


DEFAULT_FROM_STEP = 100   # recipe bug.from_step: the step a late bug that reads it first acts at


def bug_name(spec: Mapping[str, Any]) -> str:
    return str((spec.get("bug") or {}).get("name", NONE) or NONE)


def reference_left_out(rec: Mapping[str, Any]) -> str | None:
    """Why a check of a catalog bug cannot see it (a warning), or None: its recipe leaves out the
    reference its catalog entry needs (`Bug.reference`), so the single-device reference runs the same
    code as the candidate and shares the bug."""
    bug = CATALOG.get(bug_name(rec))
    if bug is None or all(_holds(rec, override) for override in bug.reference):
        return None
    return (f"bug={bug.name} is shared by a reference that runs the same code: its catalog check sets "
            f"{' '.join(bug.reference)} (`ttrace bugs {bug.name}`), without which this check cannot see it")


def _holds(rec: Mapping[str, Any], override: str) -> bool:
    """Does the recipe hold `key=value` (a value `${a.b}` read from the recipe)?"""
    def lookup(path: str) -> Any:
        node: Any = rec
        for part in path.split("."):
            node = (node or {}).get(part) if isinstance(node, Mapping) else None
        return node
    key, _, value = override.partition("=")
    ref = re.fullmatch(r"\$\{(.+)\}", value)
    return str(lookup(key)) == str(lookup(ref.group(1)) if ref else value)


def from_step(spec: Mapping[str, Any]) -> int:
    """The spec's bug.from_step (late bugs that read it: their `late` recipe sets it)."""
    return int((spec.get("bug") or {}).get("from_step", DEFAULT_FROM_STEP))


def reads_from_step(name: str) -> bool:
    bug = CATALOG.get(name)
    return bug is not None and any(o.startswith("bug.from_step=") for o in bug.late)


def active(bug: str, name: str) -> bool:
    """Is bug `name` the job's switched-on bug `bug` (Config.bug)? (`name` must be in the catalog:
    typos fail loudly.)"""
    if name not in CATALOG:
        raise KeyError(f"unknown bug switch '{name}' queried in workload code; catalog: {sorted(CATALOG)}")
    return bug == name
