"""The built-in trainer's activation recomputation (parallel.recompute, workloads/model.py) in one
process: with every block (full) or the core attention alone (selective) run again in backward, the
model's traced tensors are bit for bit those of a run without it, and the tracer says how many forwards
it matched. (A check with it: tests/ray/test_checks.py.)"""

import re

import pytest
import torch

from orchestrator.recipe import compose, job_spec
from tracer import Tracer, param_layouts
from tracer.logical import load_logical
from tracer.parameters import init_parameters
from workloads.config import parse
from workloads.model import GPTStage
from workloads.parallel_state import ParallelState
from workloads.plan import plan_for

PS = ParallelState(rank=0, sizes={"tp": 1, "dp": 1, "pp": 1}, coords={"tp": 0, "dp": 0, "pp": 0},
                   tp_group=None, dp_group=None, pp_group=None, mp_group=None)
LAYERS, MICROBATCHES = 2, 2


def _trace(root, recompute: str):
    cfg = parse(job_spec(compose(["parallel=single", f"parallel.recompute={recompute}",
                                  f"model.layers={LAYERS}"]), role="candidate", store_url=""))
    stage, plan = GPTStage(cfg, PS), plan_for(cfg.model, sp=False)
    init_parameters(stage, param_layouts(stage, plan), 7, {"tp": 0}, {"tp": 1})   # ttrace's consistent init
    tr = Tracer(str(root), recompute, 0, {"tp": 0}, {"tp": 1})
    tr.attach(stage, plan)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.model.vocab, (MICROBATCHES, 2, cfg.model.seq_len), generator=gen)
    with tr.step(0):
        for mb in range(MICROBATCHES):
            with tr.microbatch(mb):
                loss = stage(ids[mb], ids[mb].roll(-1, 1)).mean()
            tr.record_loss(loss.detach(), microbatch=mb)
            loss.backward()
        tr.record_param_grads(stage)
    tr.close()
    return load_logical(str(root), recompute, 1)


@pytest.mark.parametrize(("recompute", "per_layer"), [("full", 8), ("selective", 1)])
def test_recomputation_records_bit_for_bit_what_a_run_without_it_records(tmp_path, capsys, recompute,
                                                                        per_layer):
    plain, recomputed = _trace(tmp_path, "none"), _trace(tmp_path, recompute)
    # full: every traced module of a block again (the block, its two norms, the attention's qkv, core
    # and proj, the MLP's two linears); selective: the core attention alone
    said = re.findall(r"activation recomputation: (\d+) forwards", capsys.readouterr().err)
    assert said == [str(MICROBATCHES * LAYERS * per_layer)], said
    assert recomputed.order == plain.order and any(n.endswith("attn.core/grad_output") for n in plain.order)
    for name in plain.order:
        assert torch.equal(recomputed.tensors[name].tensor, plain.tensors[name].tensor), name
