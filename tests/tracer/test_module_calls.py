"""tracer/module_calls.py through the collector: a module called twice in one forward gets a record per
call; activation recomputation (torch.utils.checkpoint, both kinds, and torchtitan's checkpoint_wrapper
whose attribute is no part of a name: tracer.plan.unwrapped) records what a run without it records,
isolation pass included, by the plan's tracer and the DTensor one; what cannot be matched, or two
records of one name, is an error."""

import contextlib
import functools
import gc
import json
import re

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from tracer import ModuleLayout, Tracer
from tracer.errors import TraceError
from tracer.feed import ReferenceFeed
from tracer.integrations.dtensor import DTensorTracer
from tracer.logical import load_logical
from tracer.store import MANIFEST, rank_dir

PLAN = {name: ModuleLayout() for name in ("emb", "blk.a", "blk.b", "head")}


class Block(nn.Module):
    def __init__(self, grad_always: bool = False):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.grad_always = grad_always

    def forward(self, x):
        # grad_always: as Megatron's TransformerLayer runs its bias-dropout-add, under enable_grad even in
        # a checkpoint's no_grad first forward, whose graph is then dropped
        with torch.enable_grad() if self.grad_always else contextlib.nullcontext():
            return self.b(torch.tanh(self.a(x)))


class Model(nn.Module):
    """emb -> blk (once, twice, checkpointed reentrant or not, checkpointed reentrant as Megatron's layer
    with a graph in its first forward, or checkpoint-wrapped as torchtitan does) -> head."""

    def __init__(self, blk: str = "once"):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.blk, self.head = nn.Linear(4, 4), Block(grad_always=blk == "megatron"), nn.Linear(4, 4)
        self.how = blk
        if blk == "wrapped":   # non-reentrant; its parameters named blk._checkpoint_wrapped_module.a...
            self.blk = checkpoint_wrapper(self.blk)

    def forward(self, x):
        x = self.emb(x)
        if self.how in ("once", "wrapped"):
            h = self.blk(x)
        elif self.how == "twice":
            h = self.blk(self.blk(x))
        else:
            h = checkpoint(self.blk, x, use_reentrant=self.how in ("reentrant", "megatron"))
        return self.head(h)


BATCHES = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]


def train(root, run: str, model: Model, steps: int = 1, feed=None, backward: str = "per microbatch",
          batches=BATCHES, dtensor: bool = False):
    if dtensor:   # plain tensors: replicated layouts
        tr = DTensorTracer(str(root), run, 0)
        tr.attach(model, list(PLAN))
    else:
        tr = Tracer(str(root), run, 0, {}, {})
        tr.attach(model, PLAN)
    if feed is not None:
        tr.isolate(ReferenceFeed(load_logical(str(root), feed, 1), {}, {}))
    for step in range(steps):
        with tr.step(step):
            losses = []
            for i, x in enumerate(batches):
                with tr.microbatch(i):
                    losses.append(model(x).square().mean())
                if backward == "per microbatch":
                    losses.pop().backward()
            if losses:   # one backward over every microbatch's loss: autograd picks the order
                sum(losses).backward()
            tr.record_param_grads(model)
    tr.close()
    return load_logical(str(root), run, 1)


def test_a_module_called_twice_in_a_forward_gets_a_record_per_call(tmp_path):
    model = Model("twice")
    trace = train(tmp_path, "twice", model, steps=2)
    x = BATCHES[1]
    first = model.blk.a(model.emb(x))
    second = model.blk.a(model.blk(model.emb(x)))   # the weights as in step 1: the grads were never applied
    got = lambda name: trace.tensors[name].tensor.float()
    assert torch.equal(got("1/1/blk.a/output"), first) and torch.equal(got("1/1/blk.a#1/output"), second)
    # Counted per microbatch and per step: no 'blk.a#2' or '#3'; each call's gradient is its own.
    assert {n for n in trace.order if "blk.a" in n and n.startswith("1/1/")} == {
        "1/1/blk.a/output", "1/1/blk.a#1/output", "1/1/blk.a/grad_output", "1/1/blk.a#1/grad_output"}
    emb = model.emb(x).detach().requires_grad_(True)
    o1 = model.blk.a(emb)
    o2 = model.blk.a(model.blk.b(torch.tanh(o1)))
    g1, g2 = torch.autograd.grad(model.head(model.blk.b(torch.tanh(o2))).square().mean(), (o1, o2))
    assert torch.allclose(got("1/1/blk.a/grad_output"), g1)
    assert torch.allclose(got("1/1/blk.a#1/grad_output"), g2)
    assert not torch.allclose(g1, g2)


@pytest.mark.parametrize("dtensor", [False, True], ids=["plan", "dtensor"])
@pytest.mark.parametrize("how", ["reentrant", "megatron", "nonreentrant", "wrapped"])
def test_activation_recomputation_records_what_a_run_without_it_records(tmp_path, how, dtensor, capsys):
    """The recomputed forward is not recorded again, and the gradient is named by the forward it
    repeats (reentrant: backward runs through the recomputed output only, also where the first forward
    made a graph of its own, as Megatron's layer does).
    In the isolation pass the recomputation hands on the reference's output again: the activations it
    rebuilds are those the first forward handed on (the candidate's blk.a is off by 2%)."""
    run = functools.partial(train, dtensor=dtensor)
    plain, recomputed = run(tmp_path, "once", Model()), run(tmp_path, how, Model(how))
    # Said in the rank's log. Reentrant reruns blk.a and blk.b per microbatch; non-reentrant stops once
    # the tensors backward needs are rebuilt (blk.b's output is not one of them, in torch 2.13).
    said = re.findall(r"activation recomputation: (\d+) forwards", capsys.readouterr().err)
    assert said == (["4"] if how in ("reentrant", "megatron") else ["2"]), said
    assert recomputed.order == plain.order and len(plain.order) == 16 + 8
    for name in plain.order:
        assert torch.equal(recomputed.tensors[name].tensor, plain.tensors[name].tensor), name

    def off(how):
        model = Model(how)
        with torch.no_grad():
            model.blk.a.weight.mul_(1.02)
        return model
    plain = run(tmp_path, "isolated-once", off("once"), feed="once")
    recomputed = run(tmp_path, f"isolated-{how}", off(how), feed="once")
    assert recomputed.order == plain.order
    for name in plain.order:
        assert torch.equal(recomputed.tensors[name].tensor, plain.tensors[name].tensor), name
    unisolated = run(tmp_path, "off", off("once"))   # the feed did change what was recorded
    assert not torch.equal(unisolated.tensors["0/-/blk.b.weight/param_grad"].tensor,
                           plain.tensors["0/-/blk.b.weight/param_grad"].tensor)


def test_recomputations_in_another_order_than_their_forwards_are_an_error(tmp_path):
    """One backward over two microbatches' losses: autograd recomputes the later microbatch first.
    Matched to the oldest forward, its output has another shape: an error naming the module."""
    batches = [torch.randn(3, 4), torch.randn(5, 4)]
    with pytest.raises(TraceError, match=r"'blk.a' was recomputed .* shape \(5, 4\), but its oldest forward "
                                         r"not yet recomputed \('blk.a', microbatch 0\) had \(3, 4\)"):
        train(tmp_path, "order", Model("nonreentrant"), backward="once", batches=batches)
    plain = train(tmp_path, "plain", Model("once"), backward="once", batches=batches)   # no recomputation
    assert "0/1/blk.a/grad_output" in plain.order


def test_a_zero_bubble_weight_pass_recomputation_of_another_shape_is_an_error():
    """A weight pass repeats the forward its input pass recomputed, every time it recomputes it: each
    of those recomputations must have that forward's shape, as the first does."""
    from tracer.module_calls import ModuleCalls

    small, large = torch.Size([3, 4]), torch.Size([5, 4])

    def two_forwards() -> ModuleCalls:
        calls = ModuleCalls()
        calls.ran("blk.a", 0, "blk.a", small)
        calls.ran("blk.a", 1, "blk.a", large)
        assert calls.recomputed("blk.a", 0, small).microbatch == 0   # microbatch 0's input pass
        calls.repeating(True)                                          # its weight pass
        return calls

    calls = two_forwards()
    assert calls.recomputed("blk.a", 0, small).microbatch == 0
    assert calls.recomputed("blk.a", 0, small).microbatch == 0   # again, for another parameter group
    with pytest.raises(TraceError, match=r"'blk.a' was recomputed .* shape \(5, 4\), but the forward its "
                                         r"weight pass repeats \('blk.a', microbatch 0\) had \(3, 4\)"):
        calls.recomputed("blk.a", 0, large)
    with pytest.raises(TraceError, match=r"shape \(5, 4\), but the forward its weight pass repeats"):
        two_forwards().recomputed("blk.a", 0, large)   # its first recomputation in the pass


def test_two_records_of_one_name_leave_the_trace_incomplete_and_unreadable(tmp_path):
    tr = Tracer(str(tmp_path), "twice", 0, {}, {})
    with tr.step(0):
        tr.record_loss(torch.tensor(1.0), microbatch=0)
        tr.record_loss(torch.tensor(2.0), microbatch=0)
        tr.record_loss(torch.tensor(3.0), microbatch=1)
    tr.close()
    with pytest.raises(TraceError, match=r"1 name\(s\) recorded twice .*'0/0/loss/loss'"):
        load_logical(str(tmp_path), "twice", 1)
    # As an older writer committed such a trace (not marked): the reader refuses it too.
    path = tmp_path / "twice" / rank_dir(0) / MANIFEST
    manifest = json.loads(path.read_text())
    del manifest["incomplete"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(TraceError, match="rank 0 holds two tensors named '0/0/loss/loss'"):
        load_logical(str(tmp_path), "twice", 1)


def test_a_wrapped_model_is_initialized_by_its_logical_names():
    """The consistent generator draws a parameter by its name: a model wrapped for activation
    checkpointing must draw what the unwrapped reference draws (its wrapper attribute dropped)."""
    from tracer.parameters import init_parameters

    plain, wrapped = Model("once"), Model("wrapped")
    for m in (plain, wrapped):
        init_parameters(m, {}, 7, {}, {})
    assert next(n for n, _ in wrapped.named_parameters() if "_checkpoint_wrapped_module" in n)
    got = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in wrapped.named_parameters()}
    assert all(torch.equal(got[n], p) for n, p in plain.named_parameters())
    assert not torch.equal(plain.blk.a.weight, Model("once").blk.a.weight)   # the generator did draw


def test_a_traced_step_keeps_no_gc_tracked_object_per_module_call_or_record(tmp_path):
    """The taps, the gradient hooks and the calls' bookkeeping keep no object the cyclic GC tracks per
    module call or record, beyond a deque per traced module and a dict per microbatch until the step
    ends: a step grows the GC's young-generation count (each tracked object alive at its end) as an
    untraced one does, give or take those. (Tuples per call and per record made gpt_tiny's training run
    184 young-generation passes per 100 steps, against 4 untraced.)"""
    batches = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    traced, untraced = Model("twice"), Model("twice")
    tr = Tracer(str(tmp_path), "gc", 0, {}, {})
    tr.attach(traced, PLAN)

    def step(model, i: int) -> int:
        """The young generation's growth within one step (8 microbatches: 96 records, 48 module calls)."""
        gc.disable()
        try:
            with tr.step(i) if model is traced else contextlib.nullcontext():
                before = gc.get_count()[0]   # after the step's start dropped the last step's calls
                for mb, x in enumerate(batches):
                    with tr.microbatch(mb) if model is traced else contextlib.nullcontext():
                        model(x).square().mean().backward()
                if model is traced:
                    tr.record_param_grads(model)
                return gc.get_count()[0] - before
        finally:
            gc.enable()

    for i in range(2):   # the first: shapes interned, lists and parts made
        grown, plain = step(traced, i), step(untraced, i)
    tr.close()
    # a deque a module, a dict a microbatch
    assert grown - plain <= len(PLAN) + len(batches) + 4, (grown, plain)
