"""The scan's verdict over steps: every step's fingerprints (per-step stats-mode traces, tracer/
fingerprint_read.py) judged by tracer/stats_compare.py against that step's band, the tolerance the
perturbed runs' own deviations give at that step. The first step with a tensor outside its band is
`first_step`; every step gets a summary (its worst error over tolerance, per kind and per module, and
the loss of the candidate, the reference and the perturbed runs' spread) so drift reads as a curve.

Runs that start one ulp apart decorrelate: small differences grow through training (Adam turns
gradient noise near zero into whole +-lr moves), and after a few hundred steps the runs are
different trajectories that do not recorrelate (gpt_tiny tp2_dp2, synthetic tokens: grad statistics
~1e-6 apart to step ~150, ~0.5 from ~250 on). Each step's statistics are then one draw of the honest
runs' spread, whose tail R samples of one step (or of the last 8) undersample: an 8-step band left a
clean 1000-step scan at 287 steps. So the band at step s (calibrated on seeds 1234 and 7):
- never narrows: a family's noise (module path and kind, pooled over a step's microbatches as stats
  mode does) is the largest deviation of any pair of honest runs (reference and perturbed, and two
  perturbed runs: R(R+1)/2 pairs) at any step up to s;
- looks AHEAD steps on: honest runs leave the reference at random times (seed 7: all runs jump at
  step ~255, the candidate is 1.2% off by 289, the perturbed runs by ~310); the judge runs after
  every run has finished, so step s's band holds the honest deviations up to s + AHEAD;
- scales each error by the larger of the two compared runs (Band.symmetric): after decorrelation a
  gradient spike comes at a random step in each run, and against a quiet reference it is a 1000x
  error; against the larger it is at most 1 (sum: 2). Near the reference the two scales agree.
- is judged at k (tolerance.k) once a scan is longer than AHEAD steps; a shorter scan's band holds
  at most its own few steps, a sample no larger than a stats check's, and is judged at k_stats as a
  stats check is (gpt_tiny tp2_cp2 seed 14: a clean 2-step scan flagged a bias grad's norm at 1.15 of
  its band at k; 40 steps: 0.21 at k; docs/stats_mode.md "Tolerances").
The band is made of the perturbed runs only: a candidate's bug never widens it. Once it has grown, a
bug acting later must move a statistic beyond anything honest runs did to be seen.
Memory: the summaries (a few numbers per step and module), each family's noise so far, and AHEAD + 1
steps' statistics."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import combinations
from typing import Any

from tracer.compare import untrained_grads, with_untrained
from tracer.errors import TraceError
from tracer.fingerprint_read import step_of
from tracer.logical import LogicalTrace
from tracer.stats_compare import Band, band, judge, logical_stats, over_tolerance
from tracer.tolerance import TolerancePolicy
from tracer.verdicts import Comparison, TensorResult

WINDOW: int | None = None   # past steps whose noise makes a step's band; None: every step so far (module doc)
AHEAD = 32                  # and the steps after it: honest runs leave the reference at random times
BEYOND = 1e9   # err/tol reported for a tensor that failed for another reason (replicas, non-finite, shape)


def over_band(r: TensorResult) -> float:
    """How far a tensor is from its band's edge: the largest statistic's error over its tolerance
    (norm, max-abs, sum); BEYOND for a failure that is no statistic's (replicas differ, inf/nan)."""
    worst = over_tolerance(vars(r))[0]
    if not math.isfinite(worst) or (not r.ok and worst <= 1.0):
        return BEYOND
    return min(worst, BEYOND)


@dataclass
class StepSummary:
    step: int                                # global step (-1 + start: the weights as attached)
    ok: bool
    worst: float                             # max over tensors of over_band
    tensor: str                              # the worst tensor (canonical name, local step)
    kinds: dict[str, float] = field(default_factory=dict)     # kind -> worst over_band
    modules: dict[str, float] = field(default_factory=dict)   # module -> worst over_band
    loss: dict[str, float] | None = None     # candidate, reference, spread (max |perturbed - reference|)
    failing: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        r = lambda x: float(f"{x:.4g}")
        out.update(worst=r(self.worst), kinds={k: r(v) for k, v in self.kinds.items()},
                   modules={k: r(v) for k, v in self.modules.items()}, failing=self.failing[:20])
        return out


@dataclass
class ScanJudgement:
    steps: list[StepSummary]
    first_step: int | None = None          # global
    first: Comparison | None = None        # the comparison at first_step
    worst_step: int | None = None          # global step of the largest over_band (a clean scan's report)
    worst: Comparison | None = None
    worst_value: float = -1.0              # its over_band
    k: float = 0.0                         # the k the bands were judged at (tolerance.k, or k_stats)

    @property
    def verdict(self) -> str:
        return "pass" if self.first_step is None else "fail"


def mean_loss(view: LogicalTrace) -> float | None:
    """The step's mean loss over its microbatches (a scalar's sum is its value); None without one."""
    names = [n for n, e in view.info.items() if e["kind"] == "loss"]
    return sum(logical_stats(view, n).sum for n in names) / len(names) if names else None


def pair_noise(b: Band, reference: LogicalTrace) -> dict[tuple[int, str, str], list[float]]:
    """Each family's largest deviation between two perturbed runs (norm, absmax, sum errors, at the
    band's scales): more samples of what two honest runs differ by."""
    out: dict[tuple[int, str, str], list[float]] = {}
    for n in reference.order:
        f = b.family(reference, n)
        for x, y in combinations(b.perturbed, 2):
            e = b.errors(x[n], y[n], n)
            out[f] = [max(a, c) for a, c in zip(out.get(f, [0.0, 0.0, 0.0]), e, strict=True)]
    return out


Family = tuple[str, str]   # (module path, kind)
Untrained = tuple[LogicalTrace, set[str]]   # a step's whole reference, the param grads the candidate lacks
Noise = dict[Family, list[float]]


def judge_steps(reference: Iterable[LogicalTrace], candidate: Iterable[LogicalTrace],
                perturbed: Sequence[Iterable[LogicalTrace]], policy: TolerancePolicy,
                start: int = 0, window: int | None = WINDOW, ahead: int = AHEAD) -> ScanJudgement:
    """Walk the runs' steps together (each an iterable of per-step views); `start`: the global step of
    local step 0 (init.checkpoint's). Step s's band holds the honest deviations of steps s-window+1 ..
    s+ahead (window None: from the first step); window=1, ahead=0: that step's alone."""
    out = ScanJudgement([])
    held: Noise = {}                                       # window None: the running maximum
    recent: deque[tuple[int, Noise]] = deque()             # window: (index, noise) of the steps in it
    pending: deque[tuple[int, LogicalTrace, LogicalTrace, list[LogicalTrace], Band, Untrained]] = deque()
    walks = [iter(reference), iter(candidate), *(iter(p) for p in perturbed)]
    index = 0
    while True:
        views = [next(w, None) for w in walks]
        if all(v is None for v in views):
            break
        if any(v is None for v in views):
            short = [("reference", "candidate", *(f"perturbed-{i + 1}" for i in range(len(perturbed))))[i]
                     for i, v in enumerate(views) if v is None]
            raise TraceError(f"run(s) {short} logged fewer steps than the others; a job stopped early")
        ref, cand, *perts = views
        assert ref is not None and cand is not None
        step = step_of(ref)
        other = {step_of(v) for v in views if v is not None}
        if len(other) > 1 or step is None:
            raise TraceError(f"the runs' logs are out of step (steps {sorted(map(str, other))}); rerun "
                             "the scan")
        for run in perts:
            lost = [n for n in ref.order if n not in run.tensors]
            if lost:
                raise TraceError(f"run '{run.run}' did not log {len(lost)} tensor(s) the reference logged at "
                                 f"step {step}, e.g. {lost[:3]}: the runs trace different tensors")
        try:   # a candidate's param grads alone missing: failed where they lie (tracer.compare)
            untrained = untrained_grads(ref, cand)
        except TraceError as e:
            raise TraceError(f"at step {step}: {e}") from None
        whole = ref
        if untrained:
            keep = [n for n in ref.order if n not in untrained]
            ref, perts = ref.restricted(keep), [p.restricted(keep) for p in perts]
        # perts: per-step views of the perturbed runs. The initial parameters (step -1) are the
        # reference's in every run perturbed by GEMM rounding draws (bf16, fp8), which move nothing
        # before the first step: a zero band there, every later step must have moved.
        b = band(ref, perts, symmetric=True, must_move=step >= 0, where=f" at step {step}")
        pairs = pair_noise(b, ref)
        noise = {f[1:]: [max(a, c) for a, c in zip(x, pairs.get(f, x), strict=True)]
                 for f, x in b.pooled.items()}
        if window is None:
            for f, x in noise.items():
                held[f] = [max(a, c) for a, c in zip(held.get(f, x), x, strict=True)]
        else:
            recent.append((index, noise))
        pending.append((index, ref, cand, perts, b, (whole, untrained)))
        while len(pending) > ahead:
            _judge_one(out, *pending.popleft(), held, recent, window, policy, start)
        index += 1
    if index <= ahead:   # every step's band holds the whole scan, no more than a stats check's (module doc)
        policy = replace(policy, k=policy.k_stats)
    out.k = policy.k
    while pending:
        _judge_one(out, *pending.popleft(), held, recent, window, policy, start)
    return out


def _judge_one(out: ScanJudgement, index: int, ref: LogicalTrace, cand: LogicalTrace,
               perts: list[LogicalTrace], b: Band, untrained: Untrained, held: Noise,
               recent: deque[tuple[int, Noise]], window: int | None, policy: TolerancePolicy,
               start: int) -> None:
    """Judge one step against its band: the noise `held` (every step so far, and ahead) or the steps of
    `recent` from index-window+1 on. `untrained`: the step's whole reference, and the param grads the
    candidate lacks (judged without them, then failed)."""
    if window is not None:
        while recent and recent[0][0] <= index - max(1, window):
            recent.popleft()
    for f in b.pooled:
        b.pooled[f] = (held[f[1:]] if window is None
                       else [max(x) for x in zip(*(n[f[1:]] for _, n in recent if f[1:] in n), strict=True)])
    comp = judge(ref, cand, b, policy)
    whole, lost = untrained
    if lost:
        comp, ref = with_untrained(comp, whole, lost, policy), whole
    step = step_of(ref)
    assert step is not None
    s = _summary(start + step, comp, ref, cand, perts)
    out.steps.append(s)
    if out.first_step is None and not s.ok:
        out.first_step, out.first = s.step, comp
    if out.worst is None or s.worst > out.worst_value:
        out.worst_step, out.worst, out.worst_value = s.step, comp, s.worst


def _summary(step: int, comp: Comparison, ref: LogicalTrace, cand: LogicalTrace,
             perts: Sequence[LogicalTrace]) -> StepSummary:
    kinds: dict[str, float] = {}
    modules: dict[str, float] = {}
    worst, tensor = -1.0, ""
    for r in comp.results:
        x = over_band(r)
        kinds[r.kind] = max(kinds.get(r.kind, 0.0), x)
        modules[r.module] = max(modules.get(r.module, 0.0), x)
        if x > worst:
            worst, tensor = x, r.name
    loss = None
    lr, lc = mean_loss(ref), mean_loss(cand)
    if lr is not None and lc is not None:
        spread = max((abs(lp - lr) for p in perts if (lp := mean_loss(p)) is not None), default=0.0)
        loss = {"candidate": lc, "reference": lr, "spread": spread}
    return StepSummary(step, comp.verdict == "pass", max(worst, 0.0), tensor, kinds, modules, loss,
                       [r.name for r in comp.results if not r.ok])
