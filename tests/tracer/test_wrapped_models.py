"""A model attached inside DistributedDataParallel (`tr.attach(DDP(model))`, the way most data-parallel
scripts hold it) is traced under the names the unwrapped reference records: DDP's `module.` is no
part of a name, and the wrapper itself is never a traced module. A plan and the DTensor path (no plan,
leaf modules owning parameters) both."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tracer.plan import unwrapped

_RUNS = """
import json, os, socket, sys
import torch, torch.distributed as dist
from torch import nn

with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
from tracer.collector import Tracer
from tracer.integrations.dtensor import DTensorTracer
from tracer.plan import ModuleLayout

store = sys.argv[1]
for tracer, plan in (("plan", {"": ModuleLayout(), "*": ModuleLayout()}), ("dtensor", None)):
    for run, wrap in (("reference", False), ("candidate", True)):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        model = nn.parallel.DistributedDataParallel(net) if wrap else net
        cls = Tracer if plan is not None else DTensorTracer
        kw = dict(coords={}, sizes={}) if plan is not None else {}
        tr = cls(f"{store}/{tracer}", run, 0, meta={"fingerprint": "x"}, **kw)
        if plan is not None:
            tr.attach(model, plan)
        else:
            tr.attach(model)
        with tr.step(0):
            with tr.microbatch(0):
                loss = model(torch.randn(3, 4)).sum()
            loss.backward()
            tr.record_param_grads(model)
            tr.record_params(model)
        tr.close()
dist.destroy_process_group()
"""


def test_a_ddp_wrapped_model_is_traced_under_the_unwrapped_models_names(tmp_path):
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", _RUNS, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-3000:]
    for tracer in ("plan", "dtensor"):
        names = {run: sorted(e["name"] for e in json.loads(
            (tmp_path / tracer / run / "rank00000" / "manifest.json").read_text())["entries"])
            for run in ("reference", "candidate")}
        assert names["candidate"] == names["reference"], (tracer, names)
        assert "0/-/0.weight/param_grad" in names["candidate"] and "0/0/2/grad_output" in names["candidate"]
        if tracer == "plan":   # the root ("" in the plan) once: the model, not also its DDP wrapper
            assert names["candidate"].count("0/0//output") == 1, names["candidate"]


def test_only_a_leading_module_is_a_wrapper():
    assert unwrapped("module.layers.0.wq") == "layers.0.wq"
    assert unwrapped("module") == ""
    assert unwrapped("layers.module.wq") == "layers.module.wq"     # the model's own submodule
    assert unwrapped("modules.0") == "modules.0"
    assert unwrapped("module.layers.0._checkpoint_wrapped_module.wq") == "layers.0.wq"
