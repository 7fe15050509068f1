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
    # Nightly regression suite (orchestrator/nightly.py): the recipe overrides that trigger the bug,
    # and an fnmatch pattern the first divergence's "module/kind" must match.
    trigger: tuple[str, ...] = ()
    expect: str = ""


NONE = "none"

CATALOG: dict[str, Bug] = {b.name: b for b in (
    Bug("dp_grad_not_averaged",
        "data-parallel grads are all-reduced (summed) but never divided by the DP size",
        12, "dp>1", "every param_grad (x dp); first: embedding.word.weight. Adam hides it in loss/params",
        trigger=("parallel=tp2_dp2",), expect="*/param_grad"),
    Bug("sp_layernorm_grad_unreduced",
        "with TP+SP, LayerNorm weight/bias grads are not all-reduced over the TP group",
        1, "tp>1, sp", "layers.*.ln1/ln2 and final_ln weight/bias grads (param_grad; replicas disagree)",
        trigger=("parallel=tp2_sp",), expect="*ln*/param_grad"),
    Bug("row_parallel_bias_per_rank",
        "RowParallelLinear adds its bias to the partial output on every TP rank before the reduction",
        15, "tp>1", "layers.0.attn.proj output at step 1 (biases start at zero: step 0 is exact)",
        trigger=("parallel=tp2",), expect="layers.0.attn.proj/output"),
    Bug("fp8_amax_unreduced",
        "FP8 amax not reduced (MAX) across the TP group: each shard quantizes with its own scale",
        14, "tp>1, precision=fp8", 
        "layers.0.attn.qkv output, step 0 (its weight shards get their own scales)",
        trigger=("parallel=tp2", "precision=fp8"), expect="layers.0.attn.qkv/output"),
)}

# Issue 4: GQA, tied embeddings, gradient accumulation, ZeRO-1 (workloads/llama.py, grad_sync.py, zero.py).
CATALOG.update({b.name: b for b in (
    Bug("grad_accum_not_scaled",
        "with several microbatches per step the loss is not divided by the number of local microbatches "
        "before backward, so accumulated grads are that many times too large",
        17, "micro-batches per DP rank > 1 (any recipe; trigger: parallel=tp2)",
        "loss grad_output of the first microbatch (step 0): the first backward tensor"),
    Bug("kv_head_grad_unreduced",
        "GQA with fewer KV heads than TP ranks: the replicated KV projection's grads are not all-reduced "
        "over the TP ranks sharing the KV head",
        11, "model=llama_tiny (kv_heads=1), tp>1 (trigger: parallel=tp2)",
        "layers.*.attn.kv weight param_grad at step 0 (its TP replicas disagree)"),
    Bug("attention_dq_scale_wrong",
        "the explicit-backward GQA attention path computes dQ without the 1/sqrt(d) softmax scale",
        4, "model=llama_tiny (its attention code path), any layout (trigger: parallel=tp2)",
        "layers.3.attn.q grad_output (step 0, first microbatch): the last layer's dQ, first in backward"),
    Bug("tied_embedding_grad_lost_pp",
        "tied input/output embedding: the word-embedding grads of the first and last pipeline stage "
        "are not summed over the embedding group",
        6, "model=llama_tiny (tie_embeddings), pp>1 (trigger: parallel=pp2)",
        "embedding.word.weight param_grad at step 0 (first/last stage copies disagree)"),
    Bug("tied_embedding_grad_distopt",
        "with the distributed optimizer the tied-embedding all-reduce runs on the full grad buffer after "
        "the optimizer took its shards, so the shards miss the other stage's contribution",
        5, "model=llama_tiny (tie_embeddings), pp>1, zero1 (trigger: parallel=pp2_dp2_zero1)",
        "embedding.word.weight param_grad at step 0 (ZeRO shards; stage copies disagree)"),
    Bug("zero1_gather_offset_wrong",
        "the distributed optimizer all-gathers the updated parameter shards to the wrong offsets",
        18, "zero1, dp>1 (trigger: parallel=dp2_zero1)",
        "the first parameter after the step 0 update (param kind): embedding.word.weight"),
    Bug("vpp_layer_offset_wrong",
        "a virtual-pipeline chunk computes its global layer numbers with the non-interleaved formula, "
        "so it initializes (and is traced as) the wrong layers",
        13, "pp>1, vpp>1 (trigger: parallel=pp2_vpp2)",
        "layers.1 (its first submodule output, layers.1.ln1 / norm1) at step 0: the first misplaced chunk"),
    Bug("cp_loss_scaling_wrong",
        "under context parallelism each CP rank's copy of the loss is backpropagated as if the CP ranks' "
        "losses were summed: every grad is cp times too large",
        10, "cp>1 (trigger: parallel=cp2)",
        "head grad_output (step 0, first microbatch): the first tensor behind the loss gather"),
    Bug("cp_rope_offset_wrong",
        "rotary position ids are not offset for the local (zigzag) sequence chunks under CP",
        16, "model=llama_tiny, cp>1 (trigger: parallel=cp2)",
        "layers.0.attn.core output (step 0): the first attention computed with wrong rotary positions"),
    Bug("cp_attention_backward_wrong",
        "ring attention backward: a received dK/dV partial replaces the owner's accumulator instead of "
        "being added to it",
        3, "cp>1 (trigger: parallel=cp2)",
        "the last layer's qkv (gpt) / kv (llama) grad_output at step 0: the first dK/dV after the ring"),
    Bug("expert_grad_scaling_wrong",
        "MoE expert grads are divided by the expert-data-parallel size instead of the data-parallel size",
        9, "model=moe_tiny, ep>1 (trigger: parallel=ep2)",
        "the first expert weight param_grad at step 0 (layers.0.mlp.experts.*)"),
    Bug("expert_tp_grad_wrong_group",
        "expert-tensor-parallel grads are all-reduced over the TP group instead of the expert-data-parallel "
        "group (ETP>1, EP=1)",
        7, "model=moe_tiny, tp>1, ep=1, dp>1 (trigger: parallel=tp2_dp2)",
        "the first expert weight param_grad at step 0 (layers.0.mlp.experts.0.gate)"),
    Bug("grad_norm_wrong_group",
        "the global grad norm for clipping reduces the expert part over the wrong group (EDP, not EP), "
        "so EP ranks clip with different coefficients",
        8, "model=moe_tiny, ep>1, clipping active (trigger: parallel=ep2_tp2)",
        "params after the step 0 update (param kind): the first parameter, whose DP replicas disagree"),
    Bug("moe_router_grad_unreduced",
        "with TP+SP the MoE router weight lacks the sequence-parallel marking, so its grad (partial over "
        "the TP ranks' sequence chunks) is never all-reduced",
        2, "model=moe_tiny, tp>1, sp (trigger: parallel=ep2_tp2)",
        "layers.0.mlp.router weight param_grad at step 0 (its TP replicas disagree)"),
)})


def bug_name(spec: Mapping[str, Any]) -> str:
    return str((spec.get("bug") or {}).get("name", NONE) or NONE)


def active(spec: Mapping[str, Any], name: str) -> bool:
    """Is bug `name` switched on in this spec? (`name` must be in the catalog: typos fail loudly.)"""
    if name not in CATALOG:
        raise KeyError(f"unknown bug switch '{name}' queried in workload code; catalog: {sorted(CATALOG)}")
    return bug_name(spec) == name
