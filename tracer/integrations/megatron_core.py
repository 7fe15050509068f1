"""megatron-core: the tracing plan of any model built from its tensor-parallel modules, derived from
the modules' own attributes (module types, `sequence_parallel`, `gather_output`, `input_is_parallel`,
`reduce_scatter_embeddings`, the params' `sequence_parallel` tag, `layer_number`), never from names.

    plan = plan_for(model)                      # {exact module name: ModuleLayout}
    tracer.attach(model, plan, rename=layer_renaming(model))

Activations are megatron's [seq, batch, hidden]: the sequence-parallel region is sharded on dim 0,
tensor-parallel features on the last dim. The fused QKV projection is laid out per query group
([groups * (q_per_group + 2) * head_dim, hidden]) and megatron requires groups % tp == 0, so every
TP rank holds whole, contiguous groups: `Shard(0)` of the weight (and of the output's last dim)
reassembles the TP=1 logical tensor with no permutation.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import nn

from tracer.layouts import Layout, Replicate, Shard
from tracer.plan import LayerRenaming, ModuleLayout, Rename

SEQ, FEATURE = 0, -1   # megatron activations: [s, b, h]


def _sp(module: nn.Module) -> bool:
    cfg = getattr(module, "config", None)
    return bool(getattr(module, "sequence_parallel", getattr(cfg, "sequence_parallel", False)))


def _seq(sp: bool, axis: str) -> Layout:
    return Shard(SEQ, axis) if sp else Replicate()


def module_layout(module: nn.Module, *, axis: str = "tp") -> ModuleLayout | None:
    """The layout of one megatron-core module's output and parameters, or None (not traced)."""
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if isinstance(module, ColumnParallelLinear):   # output features split (whole QKV groups per rank)
        # No weight of its own where it is handed one (a tied output layer on the embedding's stage).
        params = {"weight": Shard(0, axis)} if module.weight is not None else {}
        if module.bias is not None:
            params["bias"] = Shard(0, axis)
        # Input all-gathered over the sequence under SP: the output holds the full sequence.
        out = Replicate() if module.gather_output else Shard(FEATURE, axis)
        return ModuleLayout(output=out, params=params)
    if isinstance(module, RowParallelLinear):      # input features split; bias added once, after reduce
        if not module.input_is_parallel:
            raise ValueError("RowParallelLinear(input_is_parallel=False) is not supported by this plan")
        # Output reduce-scattered along the sequence under SP, all-reduced otherwise (bias excluded
        # when skip_bias_add: the caller adds it).
        return ModuleLayout(output=_seq(module.sequence_parallel, axis), params={"weight": Shard(1, axis)})
    if isinstance(module, VocabParallelEmbedding):  # vocab rows split; output reduced over TP
        # [b, s, h] all-reduced, or [s, b, h] reduce-scattered along the sequence.
        return ModuleLayout(output=_seq(module.reduce_scatter_embeddings, axis),
                            params={"weight": Shard(0, axis)})
    if isinstance(module, LanguageModelEmbedding):  # word + position embeddings, scattered under SP
        return ModuleLayout(output=_seq(_sp(module) and module.scatter_to_sequence_parallel, axis))
    if isinstance(module, DotProductAttention):     # context of this rank's heads, concatenated
        return ModuleLayout(output=Shard(FEATURE, axis))
    if isinstance(module, TransformerLayer):        # residual stream
        return ModuleLayout(output=_seq(_sp(module), axis))
    own = list(module.parameters(recurse=False))
    if own and (isinstance(module, (nn.LayerNorm, nn.RMSNorm))
                or any(getattr(p, "sequence_parallel", False) for p in own)):
        # Norms run on this rank's sequence chunk under SP: megatron tags their params
        # `sequence_parallel` (their grads are partial sums, all-reduced in finalize_model_grads).
        return ModuleLayout(output=_seq(any(getattr(p, "sequence_parallel", False) for p in own), axis))
    return None


def plan_for(model: nn.Module, *, axis: str = "tp") -> dict[str, ModuleLayout]:
    """{module name: ModuleLayout} for every megatron-core module of `model` with a known layout
    (names regex-safe: the plan's `*` wildcard never appears in module paths)."""
    plan: dict[str, ModuleLayout] = {}
    for name, module in model.named_modules():
        entry = module_layout(module, axis=axis)
        if entry is not None and name:
            plan[name] = entry
    return plan


def layer_renaming(model: nn.Module) -> LayerRenaming:
    """Local -> global transformer layer numbers from each layer's own `layer_number` (1-based,
    pipeline offset included): `decoder.layers.0` on the second of two stages is `decoder.layers.2`."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    found: dict[str, dict[int, int]] = {}
    for name, module in model.named_modules():
        m = re.fullmatch(r"(.*\.)?layers\.(\d+)", name)
        if m and isinstance(module, TransformerLayer):
            found.setdefault(m.group(1) or "", {})[int(m.group(2))] = int(module.layer_number) - 1
    if len(found) > 1:
        raise ValueError(f"several layer stacks ({sorted(found)}); pass one renaming per stack")
    prefix, table = next(iter(found.items())) if found else ("", {})
    index = tuple(table[i] for i in range(len(table)))
    return LayerRenaming(index, pattern=rf"^{re.escape(prefix)}layers\.(\d+)")


def chunks_renaming(chunks: Sequence[nn.Module]) -> Rename:
    """A rank's virtual-pipeline chunks held as one `nn.ModuleList` (names `<chunk>.<name>`): the chunk
    index dropped and each chunk's layers numbered globally by their own `layer_number`
    (`layer_renaming`), so pp=2 x vpp=2's rank 1 names its chunks' layers 1 and 3."""
    renames = [layer_renaming(c) for c in chunks]

    def rename(name: str) -> str:
        head, _, rest = name.partition(".")
        return renames[int(head)](rest) if head.isdigit() and int(head) < len(renames) else name
    return rename


def tied_renaming(rename: Rename) -> Rename:
    """`rename`, and a tied output layer's weight named as the word embedding it is: with
    `share_embeddings_and_output_weights` and pp > 1, the last stage holds its own copy of the word
    embedding as `output_layer.weight`, kept equal to the first stage's (its grads summed over the
    embedding group). Both stages then record the one logical tensor, as replicas whose bits must agree;
    at pp = 1 there is no such parameter."""
    def renamed(name: str) -> str:
        out = rename(name)
        return "embedding.word_embeddings.weight" if out == "output_layer.weight" else out
    return renamed
