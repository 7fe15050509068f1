"""Third-party frameworks under test, each one job of the job contract (tracer/job.py): its module's
`main()` is the entrypoint (`job=megatron_core|torch_native|hf`, recipes/job/) and its `validate(spec)`
refuses, before anything is scheduled, a recipe it cannot run. Per-rank setup is the shared harness
(workloads/harness.py). Modules are imported only by their own jobs: a framework's library is an
optional extra.
"""
