"""ttrace's own jobs: the built-in Megatron-style trainer (TP/SP/DP/PP/VPP/ZeRO/CP/EP, fp32/bf16/fp8)
with its catalog of injectable bugs, and the framework jobs (workloads/adapters/).

Each is a job of the job contract: `workloads.train:main` (the built-in trainer) and the frameworks'
`main` are entrypoints on one per-rank harness (workloads/harness.py); `workloads.plan.plan_for`
declares every sharding rule once, for both weight slicing and trace reassembly.
"""
