"""tracer.integrations.pipelining on real torch.distributed.pipelining schedules (2 gloo ranks: 1F1B,
and two zero-bubble ones): every traced forward and gradient is named after its global microbatch,
once, and the stage's metadata inference (a dry forward and backward in the first step) records nothing.
The torch-native job's stage split (workloads/adapters/torch_pipeline.py) keeps global names."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tracer.integrations.pipelining import stages_renaming

_TWO_RANKS = """
import os, socket, sys
from collections import OrderedDict
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch import nn

def rank(r, store, port, first, schedule):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=2)
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class
    from tracer.collector import Tracer
    from tracer.integrations.pipelining import stages_renaming, trace_microbatches
    from tracer.plan import ModuleLayout

    torch.manual_seed(0)
    single = schedule in ("1F1B", "GPipe")
    ids = [r] if single else [r, 2 * 2 - 1 - r] if schedule == "ZBVZeroBubble" else [r, r + 2]
    net = nn.Sequential(*(nn.Linear(4, 4) for _ in range(2 if single else 4)))
    parts = [nn.Sequential(OrderedDict([(str(i), net[i])])) for i in ids]   # stages keep their layers' names
    tr = Tracer(store, "candidate", r, coords={"pp": r}, sizes={"pp": 2}, meta={"fingerprint": "seq"})
    traced = parts[0] if single else nn.ModuleList(parts)
    plan = {"*" if single else "*.*": ModuleLayout()}   # the Linears (a plan matches local names)
    tr.attach(traced, plan, rename=None if single else stages_renaming(len(parts)))
    tr.set_grad_scale(1.0)
    stages = [PipelineStage(m, i, len(net), torch.device("cpu")) for i, m in zip(ids, parts)]
    trace_microbatches(tr, stages, first=first)
    sched = get_schedule_class(schedule)(stages[0] if single else stages, n_microbatches=2,
                                         loss_fn=lambda out, y: (out - y).pow(2).mean())
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    for step in range(2):
        with tr.step(step):
            sched.step(*((x,) if 0 in ids else ()), target=y)
    tr.close()
    dist.destroy_process_group()

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    mp.start_processes(rank, args=(sys.argv[1], port, int(sys.argv[2]), sys.argv[3]), nprocs=2,
                       start_method="fork")
"""


# 1F1B: one stage a rank. The zero-bubble ones split each backward into an input pass and a weight
# pass, which delivers a stage's output grads again (recorded once: Tracer.repeated_backward), two
# stages a rank, looped or in a V.
@pytest.mark.parametrize("schedule", ["1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"])
def test_a_pipeline_schedules_forwards_are_named_after_their_microbatches(tmp_path, schedule):
    store, first = tmp_path / "store", 4   # DP rank 2 of a run with 2 microbatches per DP rank
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", _TWO_RANKS, str(store), str(first), schedule],
                         capture_output=True, text=True, timeout=180, env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-3000:]
    layers = {"1F1B": [[0], [1]], "InterleavedZeroBubble": [[0, 2], [1, 3]],
              "ZBVZeroBubble": [[0, 3], [1, 2]]}   # each rank's stages, one Linear each
    for r in range(2):
        entries = json.loads((store / "candidate" / f"rank{r:05d}" / "manifest.json").read_text())["entries"]
        acts = sorted(e["name"] for e in entries if e["kind"] in ("output", "grad_output"))
        # each step's two microbatches, forward and backward, once each: no dry run among them
        assert acts == sorted(f"{s}/{m}/{i}/{k}" for s in range(2) for m in (first, first + 1)
                              for i in layers[schedule][r] for k in ("output", "grad_output")), acts


def test_stages_renaming_drops_the_stage_index():
    rename = stages_renaming(2)
    assert rename("1.layers.3.attention.wq") == "layers.3.attention.wq"
    assert rename("0.tok_embeddings") == "tok_embeddings"
    assert rename("2.layers.0") == "2.layers.0"     # no such stage: left as it is
    assert rename("layers.0") == "layers.0"


@pytest.mark.parametrize("pp,vpp", [(2, 1), (2, 2)])
def test_torch_native_stages_keep_global_names_and_the_weights(pp, vpp):
    from orchestrator.recipe import compose, job_spec
    from workloads.adapters import torch_native, torch_pipeline
    from workloads.config import parse

    cfg = parse(job_spec(compose(["job=torch_native", f"parallel=pp{pp}" + ("_vpp2" if vpp > 1 else ""),
                                  "++model.tie_embeddings=false"]), role="candidate", store_url=""))
    model = torch_native.Transformer(cfg)
    whole = dict(model.named_parameters())
    seen: dict[str, int] = {}
    for pp_rank in range(pp):
        parts = torch_pipeline.stage_modules(model, cfg, pp_rank)
        assert [s for s, _ in parts] == [pp_rank + v * pp for v in range(vpp)]
        for s, part in parts:
            layers = sorted(int(k) for k in part.layers.keys())
            per = cfg.model.layers // (pp * vpp)
            assert layers == list(range(s * per, (s + 1) * per))
            assert (part.tok_embeddings is not None) == (s == 0)
            assert (part.output is not None) == (part.norm is not None) == (s == pp * vpp - 1)
            for name, p in part.named_parameters():
                assert torch.equal(p, whole[name]), name   # global name, same weights
                seen[name] = seen.get(name, 0) + 1
    assert seen == dict.fromkeys(whole, 1)   # every parameter on exactly one stage
