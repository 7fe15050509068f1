"""The one place this workload's sharding rules live (Megatron TP/SP), as a torchtitan-style plan.

The same plan slices the initial weights (train.init_weights via tracer.param_layouts) and tells the
tracer how to reassemble every traced tensor. Activations are [batch, seq, hidden]; PP needs no
layout (stages own distinct names) and DP needs none (DP ranks trace distinct microbatches).
"""

from __future__ import annotations

from tracer import Layout, ModuleLayout, Replicate, Shard


def gpt_plan(sp: bool) -> dict[str, ModuleLayout]:
    """Module-name pattern (`*` = one path component) -> output and parameter layouts."""
    seq = Shard(1, "tp") if sp else Replicate()    # LayerNorm regions: sequence-sharded under SP
    col = {"weight": Shard(0, "tp"), "bias": Shard(0, "tp")}   # output features split over TP
    row = {"weight": Shard(1, "tp")}                            # input features split; bias replicated
    return {
        "embedding": ModuleLayout(output=seq, params={"word.weight": Shard(0, "tp")}),  # vocab rows
        "layers.*.ln1": ModuleLayout(output=seq),
        "layers.*.attn.qkv": ModuleLayout(output=Shard(2, "tp"), params=col),   # whole heads per rank
        "layers.*.attn.core": ModuleLayout(output=Shard(2, "tp")),              # local heads, concatenated
        "layers.*.attn.proj": ModuleLayout(output=seq, params=row),
        "layers.*.ln2": ModuleLayout(output=seq),
        "layers.*.mlp.fc1": ModuleLayout(output=Shard(2, "tp"), params=col),
        "layers.*.mlp.fc2": ModuleLayout(output=seq, params=row),
        "layers.*": ModuleLayout(output=seq),
        "final_ln": ModuleLayout(output=seq),
        # LM head: vocab rows sharded, logits stay vocab-sharded for the parallel cross-entropy.
        "head": ModuleLayout(output=Shard(2, "tp"), params={"weight": Shard(0, "tp")}),
        "loss": ModuleLayout(output=Replicate()),   # per-token loss [b, s]
    }


def llama_plan(sp: bool, tied: bool = False) -> dict[str, ModuleLayout]:
    """Llama variant (workloads/llama.py): RMSNorm, SwiGLU (gate/up/down), GQA with a separate KV
    projection sharded over the derived `kv` axis and replicated over `kvr` (the TP ranks sharing a KV
    head); its output grad is a partial sum over those ranks (each backpropagates its own query heads)."""
    seq = Shard(1, "tp") if sp else Replicate()
    col = {"weight": Shard(0, "tp")}
    row = {"weight": Shard(1, "tp")}
    kv_out = Shard(2, "kv")
    return {
        # Tied: the last stage's copy of the word embedding has the same name and layout (pp = replica).
        "embedding": ModuleLayout(output=seq, params={"word.weight": Shard(0, "tp")}),
        "layers.*.norm1": ModuleLayout(output=seq),
        "layers.*.attn.q": ModuleLayout(output=Shard(2, "tp"), params=col),
        "layers.*.attn.kv": ModuleLayout(output=kv_out, params={"weight": Shard(0, "kv")},
                                         grad=Layout(shard=((2, "kv"),), partial=("kvr",))),
        "layers.*.attn.core": ModuleLayout(output=Shard(2, "tp")),
        "layers.*.attn.proj": ModuleLayout(output=seq, params=row),
        "layers.*.norm2": ModuleLayout(output=seq),
        "layers.*.mlp.gate": ModuleLayout(output=Shard(2, "tp"), params=col),
        "layers.*.mlp.up": ModuleLayout(output=Shard(2, "tp"), params=col),
        "layers.*.mlp.down": ModuleLayout(output=seq, params=row),
        "layers.*": ModuleLayout(output=seq),
        "final_norm": ModuleLayout(output=seq),
        "head": ModuleLayout(output=Shard(2, "tp"), params={} if tied else col),
        "loss": ModuleLayout(output=Replicate()),
    }


def moe_plan(sp: bool, tied: bool = False) -> dict[str, ModuleLayout]:
    """llama_plan with MoE MLPs (workloads/moe.py): the router's logits per token, the layer output;
    experts are tensor-parallel SwiGLUs whose outputs (a variable set of routed tokens) are not traced.
    Expert numbers are renamed to global ones (EP); expert weights are replicated over EDP."""
    seq = Shard(1, "tp") if sp else Replicate()
    col = {"weight": Shard(0, "tp")}
    moe = {
        "layers.*.mlp.router": ModuleLayout(output=seq),   # per-token logits of this rank's tokens
        "layers.*.mlp.experts.*.gate": ModuleLayout(trace=False, params=col),
        "layers.*.mlp.experts.*.up": ModuleLayout(trace=False, params=col),
        "layers.*.mlp.experts.*.down": ModuleLayout(trace=False, params={"weight": Shard(1, "tp")}),
        "layers.*.mlp": ModuleLayout(output=seq),
    }
    return {**moe, **llama_plan(sp, tied)}


def plan_for(model_cfg, sp: bool) -> dict[str, ModuleLayout]:  # noqa: ANN001 - workloads.config.ModelConfig
    """The plan of the configured model architecture."""
    if model_cfg.arch == "llama" and model_cfg.experts:
        return moe_plan(sp, model_cfg.tie_embeddings)
    if model_cfg.arch == "llama":
        return llama_plan(sp, model_cfg.tie_embeddings)
    return gpt_plan(sp)
