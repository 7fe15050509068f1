"""The excusal count rule (tracer.judge.beyond_limit) on hand-built traces through tracer.measure:
a parameter whose gradient is within noise of zero everywhere (every post-step element excused),
three perturbed runs that stay within 2x of one another, and a candidate that is honest but for a
few elements (as from trained Adam state: docs/tolerance.md "From trained weights") passes, while
the reference's update reversed on 10% of the elements fails."""

import torch

from tracer.judge import beyond_limit
from tracer.measure import TensorKey, measure
from tracer.tolerance import TolerancePolicy

N = 4096
U = 2.0**-24


def _traces(beyond: int, flipped: int):
    g = torch.Generator().manual_seed(1)
    sign = lambda: torch.randint(0, 2, (N,), generator=g) * 2.0 - 1.0
    keys = [TensorKey(name, name.rsplit("/", 1)[1], "w", U, N)
            for name in ("0/-/w/param", "1/-/w/param_grad", "1/-/w/param")]
    before = torch.randn(N, generator=g)
    update = 1e-3 * sign()
    ref = {keys[0].name: before, keys[1].name: 1e-9 * sign(), keys[2].name: before + update}
    # Each run's deviation is 1-2 units of 1e-7 (gradient noise 1e-8 around a 1e-9 gradient: all
    # within noise of zero), so no perturbed run is beyond k_elem x the others' envelope.
    dev = lambda scale: scale * (1 + torch.rand(N, generator=g)) * sign()
    perts = [{keys[0].name: before, keys[1].name: ref[keys[1].name] + dev(1e-8),
              keys[2].name: ref[keys[2].name] + dev(1e-7)} for _ in range(3)]
    cand = {keys[0].name: before, keys[1].name: ref[keys[1].name] + dev(1e-8),
            keys[2].name: ref[keys[2].name] + dev(1e-7)}
    p = cand[keys[2].name]
    p[:beyond] = ref[keys[2].name][:beyond] + 20 * 2e-7         # honest outliers: 10x the envelope
    p[N - flipped:] = (before - update)[N - flipped:]             # the update reversed
    return keys, ref, cand, perts


def _count(beyond: int, flipped: int) -> tuple[int, int, int]:
    keys, ref, cand, perts = _traces(beyond, flipped)
    st = measure(keys, ref, cand, perts, TolerancePolicy().k_elem)["1/-/w/param"]
    return st.excused, st.beyond, st.beyond_noise


def test_a_few_honest_outliers_pass_and_a_systematic_flip_fails():
    k = TolerancePolicy().k
    excused, beyond, noise = _count(beyond=8, flipped=0)
    assert (excused, beyond, noise) == (N, 8, 0)
    # The rule before trained-state calibration, k x (noise + 1) = 4, failed this honest candidate.
    assert k * (noise + 1) < beyond <= beyond_limit(excused, noise, k)

    excused, beyond, noise = _count(beyond=0, flipped=N // 10)
    assert excused == N and beyond == N // 10 and noise == 0
    assert beyond > beyond_limit(excused, noise, k)
    # and the limit stays a small fraction of the excused population
    assert beyond_limit(excused, noise, k) < 0.01 * excused
