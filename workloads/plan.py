"""The one place this workload's sharding rules live (Megatron TP/SP), as a torchtitan-style plan.

The same plan slices the initial weights (train.init_weights via tracer.param_layouts) and tells the
tracer how to reassemble every traced tensor. Activations are [batch, seq, hidden]; PP needs no
layout (stages own distinct names) and DP needs none (DP ranks trace distinct microbatches).
"""

from __future__ import annotations

from tracer import ModuleLayout, Replicate, Shard


def tracing_plan(sp: bool) -> dict[str, ModuleLayout]:
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
