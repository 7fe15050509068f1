"""Routing flips beside an MoE FAIL (tracer/routing.py): counted from the traced router outputs."""

from __future__ import annotations

import torch

from tracer import Tracer
from tracer.logical import load_logical
from tracer.routing import routing_flips

# 4 tokens x 4 experts; token 2's 2nd and 3rd choices nearly tie (probabilities 0.25 +- 1e-3)
LOGITS = torch.tensor([[3.0, 2.0, 0.0, -1.0],
                       [0.0, 3.0, 2.0, -1.0],
                       [2.0, 0.004, 0.0, -3.0],
                       [-1.0, 0.0, 2.0, 3.0]])


def _run(root, run: str, logits: torch.Tensor, module_type: str = "Router") -> None:
    tr = Tracer(str(root), run, 0, coords={}, sizes={}, meta={"fingerprint": "moe"})
    with tr.step(0):
        tr.record("layers.0.mlp.router", "output", logits, microbatch=0, module_type=module_type)
        tr.record("layers.0.mlp", "output", logits.exp(), microbatch=0, module_type="MoE")   # same part
    tr.close()


def _load(root, run):
    return load_logical(str(root), run, 1, lazy=True)   # as a check reads them


def test_the_candidates_flipped_tokens_are_counted_with_their_margin(tmp_path):
    swapped = LOGITS.clone()
    swapped[2, 1], swapped[2, 2] = LOGITS[2, 2], LOGITS[2, 1]   # token 2 takes expert 2 instead of 1
    _run(tmp_path, "reference", LOGITS)
    _run(tmp_path, "candidate", swapped)
    _run(tmp_path, "perturbed-0", LOGITS)
    _run(tmp_path, "perturbed-1", swapped)
    ref, cand = _load(tmp_path, "reference"), _load(tmp_path, "candidate")
    pert = [_load(tmp_path, "perturbed-0"), _load(tmp_path, "perturbed-1")]
    for run in (ref, cand, *pert):   # the comparison's walk reads every tensor once
        for name in run.order:
            run.tensors[name]
    got = routing_flips(ref, cand, pert, top_k=2)
    assert got is not None
    assert (got.routers, got.tokens, got.candidate, got.perturbed) == (1, 4, 1, [0, 1])
    probs = LOGITS[2].double().softmax(-1)
    assert abs(got.largest_flip_margin - float(probs[1] - probs[2])) < 1e-12
    assert got.largest_flip_margin < 1e-3 < got.median_margin
    assert "1 of 4 routed tokens" in got.warning()
    # lookups after a comparison's walk keep no part file in memory once the diagnosis is done
    assert all(not run.tensors.parts.held for run in (ref, cand, *pert))
    # the same runs without the flip: nothing flipped, and nothing to warn about
    clean = routing_flips(_load(tmp_path, "reference"), _load(tmp_path, "perturbed-0"), [], top_k=2)
    assert clean is not None and clean.candidate == 0 and clean.largest_flip_margin == 0.0


def test_runs_without_a_router_have_no_routing_figures(tmp_path):
    _run(tmp_path, "reference", LOGITS, module_type="Linear")
    ref = _load(tmp_path, "reference")
    assert routing_flips(ref, ref, [], top_k=2) is None


def test_a_router_output_of_another_shape_is_left_to_the_verdict(tmp_path):
    _run(tmp_path, "reference", LOGITS)
    _run(tmp_path, "candidate", LOGITS[:3])   # a token lost: the verdict names it, no flips counted
    assert routing_flips(_load(tmp_path, "reference"), _load(tmp_path, "candidate"), [], top_k=2) is None
