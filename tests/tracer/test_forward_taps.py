"""tracer/forward_taps.py: the tracer's hook after a module's forward and on its output's gradient
behave as a forward hook and `register_hook` would, at a lower cost per call."""

import copy

import torch
from torch import nn

from tracer.forward_taps import on_grad, tap_forward


def _seen(log: list, replace: torch.Tensor | None = None):
    def hook(module, args, output):
        log.append((module, args, output.detach().clone()))
        return replace
    return hook


def test_a_module_without_hooks_is_tapped_on_its_forward_and_keeps_the_fast_call_path():
    m, x = nn.Linear(3, 2), torch.randn(4, 3)
    log: list = []
    handle = tap_forward(m, _seen(log))
    assert not m._forward_hooks and "forward" in m.__dict__   # nn.Module.__call__'s fast path
    y = m(x)
    assert len(log) == 1 and log[0][0] is m and log[0][1][0] is x and torch.equal(log[0][2], y)
    twin = copy.deepcopy(m)   # a copy's forward is the copy's own, tapped like a copied forward hook
    with torch.no_grad():
        twin.weight.add_(1)
    assert torch.equal(twin(x), log[-1][2]) and log[-1][0] is twin and not torch.equal(log[-1][2], y)
    handle.remove()
    assert "forward" not in m.__dict__
    m(x)
    assert len(log) == 2


def test_the_taps_return_replaces_the_output_and_later_hooks_see_the_replacement():
    m, x = nn.Linear(3, 2), torch.randn(4, 3)
    sub = torch.zeros(4, 2)
    later: list = []
    tap_forward(m, _seen([], replace=sub))
    m.register_forward_hook(_seen(later))   # registered after the tap: runs after it, as hooks do
    assert torch.equal(m(x), sub) and torch.equal(later[0][2], sub)


def test_a_module_with_hooks_gets_a_forward_hook_after_its_own():
    m, x = nn.Linear(3, 2), torch.randn(4, 3)
    m.register_forward_hook(lambda mod, args, out: out * 2)   # e.g. a parallel style's output hook
    log: list = []
    tap_forward(m, _seen(log))
    assert "forward" not in m.__dict__ and len(m._forward_hooks) == 2
    y = m(x)
    assert torch.equal(log[0][2], y) and torch.allclose(y, 2 * nn.functional.linear(x, m.weight, m.bias))


def test_a_gradient_hook_sees_the_gradient_and_leaves_room_for_others():
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    got: list = []
    on_grad(y, lambda g: got.append(g.clone()))
    y.register_hook(lambda g: g * 10)          # a hook registered later still runs, after it
    (y * torch.arange(3.0)).sum().backward()
    assert torch.equal(got[0], torch.arange(3.0)) and torch.equal(x.grad, 20 * torch.arange(3.0))
    leaf, seen = torch.randn(2, requires_grad=True), []
    on_grad(leaf, lambda g: seen.append(g))    # no autograd node: the usual register_hook
    leaf.sum().backward()
    assert len(seen) == 1 and leaf._backward_hooks
