"""Framework-specific helpers for the tracer (imported explicitly: each needs its library).

`tracer.integrations.dtensor`: layouts from DTensor placements (torch-native TP/SP/FSDP2, HF TP);
`tracer.integrations.hf`: output layouts of transformers' TP styles;
`tracer.integrations.megatron_core`: megatron-core's plan and layer names;
`tracer.integrations.pipelining`: torch.distributed.pipelining's microbatches and stage names.
"""
