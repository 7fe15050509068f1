"""The built-in system under test: a Megatron-style GPT trainer (TP/SP/DP/PP) with injectable bugs.

`workloads.train.run_rank` is the per-rank entry point; `workloads.plan.tracing_plan` declares every
sharding rule once, for both weight slicing and trace reassembly.
"""
