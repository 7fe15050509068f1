"""Performance of ttrace itself, all figures measured in one run -> bench/perf.json and a table.

- tracer_overhead (the goals of issue 16): gpt_tiny's median step time with full tracing and with
  trace.mode=stats over the untraced step, after (the current writer) and before (the previous
  writer, kept below as LegacyTraceWriter: a copy per tensor, safetensors.save, sha256), all in the
  same run, in fresh processes interleaved round by round. Exits 1 when a goal is missed
  (full <= 1.3x, stats <= 1.1x).
  `paired` beside them: the same ratio with traced and untraced steps (taps off) interleaved in blocks
  of 4 in one process (_paired_session), steadier on a shared machine; a diagnostic, not the goal's
  figure. `paired.hooks_only`: the same with the writer's `add` doing nothing, what tracing costs
  before a single byte is recorded (the taps and gradient hooks, the records' names): the floor no
  change of the writer can go under on this model. `paired.no_write` (gpt_tiny): full mode's records
  taken, the parts given back unwritten: what writing the files (header, checksum, the O_DIRECT write)
  costs the training thread beside it. `paired_by_model`: the same three figures for
  two wider models (hidden 128 and 256) with the trace bytes per traced step: what costs per record
  (the taps) and what per byte (the snapshot and the writer), a diagnostic.
- tracer overhead: step time, wall time of the whole job (including the trace flush at close) and
  peak RSS with full tracing vs `Tracer.disabled()`, and trace bytes per step, for gpt_tiny and a
  4x larger model (hidden 128, ffn 512: 4x the parameters). One single-rank gloo job per spawned
  process, so peak RSS is that configuration's own.
- comparison throughput: GB/s of trace compared (`load_logical` + `compare`, reference + R
  perturbed + candidate, in a fresh process: its peak RSS too) vs the raw read throughput of the
  same files from the same store.
- scaling: compare time for 1x, 4x, 16x trace sizes (model.layers 2, 8, 32).
- compare.throughput_ratio_to_raw_read (1x, 16x; goals >= 0.3, >= 0.5): before (the comparison as of
  commit COMPARE_BASELINE, the last before its compiled kernels, or --compare-before's, run from that
  commit's files exported to a temporary directory) and after (this tree), same run, same stores,
  fresh processes.
- check_latency.ratio_to_longest_job (goal <= 1.5): the demo check's wall time over its longest job
  on a warm cluster, before (that comparison) and after, same run. check_latency.command: the same
  for a user's script (a command job), each rank a fresh interpreter (before) or forked warm (after).
- end-to-end latency of the demo check (default recipe, MLflow on, cold reference cache) by stage.
Exits 1 when a goal is missed (an --only run: a goal of what it measured). An --only run adds its
sections to the existing perf.json: `measured` says, per section, the date, commit and machine of
the run that measured it.

Usage: python bench/perf.py [--steps 6] [--skip-e2e] [--only-tracer-overhead [--rounds 3]]
       [--only-compare [--scales 1x,16x] [--compare-rounds 3] [--compare-before COMMIT]]
       [--only-check-latency] [--only-e2e]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "bench" / "perf.json"
MODELS = {"gpt_tiny": [], "gpt_tiny_4x": ["model.hidden=128", "model.ffn_hidden=512"]}
SCALES = {"1x": 2, "4x": 8, "16x": 32}   # model.layers: trace size grows linearly with depth
R = 3
CANDIDATE, CANDIDATE_RANKS = "tp2", 2   # the compared candidate is sharded, never the reference's twin


def _spec(overrides: list[str], store: str, run: str, *, trace: bool = True,
          perturb_seed: int | None = None, parallel: str = "single") -> dict[str, Any]:
    from orchestrator.recipe import compose, job_spec

    rec = compose([f"parallel={parallel}", *overrides])
    spec = job_spec(rec, role="perturbed" if perturb_seed else "candidate", run=run, store_url=store,
                    perturb=perturb_seed)
    spec["trace"]["enabled"] = trace
    return spec


def _timed_session(spec: dict[str, Any], env: dict[str, str], times: list[float],
                   cpu: list[float] | None = None) -> Any:
    """The job's session (tracing on or off), timing each `step` block (wall; `cpu`: the process's CPU
    time in it, every thread: the writer thread's work is counted where it overlaps the step)."""
    import contextlib

    from tracer.job import Session
    from tracer.job_config import JobConfig

    class TimedSession(Session):
        def step(self, step: int) -> Any:
            @contextlib.contextmanager
            def timed():
                t0, c0 = time.perf_counter(), time.process_time()
                with Session.step(self, step):
                    yield
                times.append(time.perf_counter() - t0)
                if cpu is not None:
                    cpu.append(time.process_time() - c0)
            return timed()

    return TimedSession(JobConfig.from_spec(spec, env=env))


PAIRED_BLOCK = 4   # paired: this many steps traced, then as many with tracing paused, in turn


def _paired_session(spec: dict[str, Any], env: dict[str, str], traced: list[float],
                    paused: list[float]) -> Any:
    """The job's session with tracing off on every other block of PAIRED_BLOCK steps: traced and
    untraced steps of ONE process, interleaved every ~0.2 s, well under the swings of a shared
    machine's load, which move the step time of separate processes by 10-30% (the interleaved
    rounds of `tracer_overhead` average them out only over many rounds). A block's first step is
    not counted: it pays the writer thread's work on the block before (and step 0, one-off
    allocations). An untraced block runs with the taps taken off its modules (tracer/forward_taps.py),
    so its steps are as a run without ttrace takes them (until 2026-11-27 they passed through the
    idle taps, and the ratio erred low by ~0.4 ms of a gpt_tiny step)."""
    import contextlib

    from tracer.forward_taps import ForwardTap
    from tracer.job import Session
    from tracer.job_config import JobConfig

    def taps(tracer: Any, on: bool) -> None:
        for h in tracer._handles:
            if isinstance(h, ForwardTap):   # a module with hooks of its own keeps its hook, idle
                if on:
                    h._module.forward = h._wrapper
                else:
                    h._module.__dict__.pop("forward", None)

    class PairedSession(Session):
        def step(self, step: int) -> Any:
            @contextlib.contextmanager
            def timed():
                block, at = divmod(step, PAIRED_BLOCK)
                on, tracer = block % 2 == 0, self._tracer
                if at == 0:
                    taps(tracer, on)
                t0 = time.perf_counter()
                with Session.step(self, step):
                    if not on:   # what the hooks and records check (tracer.collector.Tracer)
                        tracer._step, tracer.enabled = None, False
                    try:
                        yield
                    finally:
                        tracer._step, tracer.enabled = step, True
                if at:
                    (traced if on else paused).append(time.perf_counter() - t0)
            return timed()

    return PairedSession(JobConfig.from_spec(spec, env=env))


def _train_paired(spec: dict[str, Any], q: Any, hooks_only: bool = False, no_write: bool = False) -> None:
    """Child process: one single-rank job timed by `_paired_session`. `hooks_only`: the writer records
    nothing (its `add` returns at once), every hook still runs. `no_write`: every record is taken as in
    full mode, and the writer thread gives each part back unwritten (no header, checksum or file): what
    writing the trace costs the training thread beside it."""
    import tracer.writer
    from tracer.heap import gc_frozen
    from workloads import train

    if hooks_only:
        tracer.writer.TraceWriter.add = lambda self, fields, tensor: None  # type: ignore[method-assign]
    if no_write:
        tracer.writer.TraceWriter._write_direct = lambda self, name, part, slots: True  # type: ignore

    traced: list[float] = []
    paused: list[float] = []
    with gc_frozen():   # as ttrace's launcher runs an entrypoint job (orchestrator/jobs.py)
        train.main(_paired_session(spec, _single_rank_env(), traced, paused))
    steps = int(spec["steps"])   # a block's first step is traced too, only not counted
    q.put({"traced": traced, "paused": paused,
           "traced_steps": sum(1 for s in range(steps) if s // PAIRED_BLOCK % 2 == 0)})


# tracer.writer.FIELDS (bench must not depend on it for the old writer's sake)
_FIELDS = ("name", "module", "module_type", "kind", "step", "microbatch", "seq", "layout", "scale")


class LegacyTraceWriter:
    """The trace writer before issue 16 (the `before` of tracer_overhead): a fresh copy of every tensor
    on the training thread, then `safetensors.save` (a second copy, holding the GIL), a write and a
    sha256 per part on a background thread."""

    def __init__(self, root: str, run: str, rank: int, header: dict[str, Any], flush_bytes: int = 32 << 20,
                 **_: Any):
        import queue
        import threading

        from tracer.store import _fs, rank_dir

        self.fs, base = _fs(root)
        self.dir = f"{base}/{run}/{rank_dir(rank)}"
        self.fs.makedirs(self.dir, exist_ok=True)
        self.header, self.flush_bytes = header, flush_bytes
        self.entries: list[dict[str, Any]] = []
        self.files: list[dict[str, Any]] = []
        self._buf: dict[str, Any] = {}
        self._buf_bytes = self._parts = 0
        self._queue: Any = queue.Queue(maxsize=4)
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def add(self, fields: tuple, tensor: Any) -> None:
        entry = dict(zip(_FIELDS, fields, strict=True))   # the old writer took the entry as a dict
        tensor = tensor.detach().to("cpu", copy=True)
        self.entries.append(dict(entry, key=entry["name"], file=f"part-{self._parts:05d}.safetensors",
                                 shape=list(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch.")))
        self._buf[entry["name"]] = tensor.contiguous()
        self._buf_bytes += tensor.numel() * tensor.element_size()
        if self._buf_bytes >= self.flush_bytes:
            self.flush()

    def flush(self) -> None:
        if self._buf:
            self._queue.put((f"part-{self._parts:05d}.safetensors", self._buf))
            self._parts += 1
            self._buf, self._buf_bytes = {}, 0

    def close(self, incomplete: str | None = None) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join()
        manifest = dict(self.header, format="ttrace-trace/1", files=self.files, entries=self.entries)
        with self.fs.open(f"{self.dir}/manifest.json", "w") as f:
            f.write(json.dumps(manifest))

    def _drain(self) -> None:
        import hashlib

        from safetensors.torch import save

        while (item := self._queue.get()) is not None:
            name, tensors = item
            data = save(tensors)
            with self.fs.open(f"{self.dir}/{name}", "wb") as f:
                f.write(data)
            self.files.append({"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})


def _train(specs: list[dict[str, Any]], q: Any, legacy: bool = False) -> None:
    """Child process: run each single-rank job in turn (the built-in job's entrypoint, as ttrace's
    launcher calls it); report step times, wall, CPU time and peak RSS. `legacy`: trace with the
    writer before issue 16."""
    from tracer.heap import gc_frozen
    from workloads import train

    if legacy:
        import tracer.collector

        tracer.collector.TraceWriter = LegacyTraceWriter  # type: ignore[misc,assignment]
    out = []
    for spec in specs:
        times: list[float] = []
        cpu: list[float] = []
        env = _single_rank_env()
        t0 = time.perf_counter()
        # As ttrace's launcher runs an entrypoint job (orchestrator/jobs.py): the process's heap of
        # imports left out of the GC's passes. Unfrozen, a full pass over it (~160 ms) fell in a
        # traced step of every full-mode process here (step 2), and in none of the untraced ones.
        with gc_frozen():
            train.main(_timed_session(spec, env, times, cpu))
        out.append({"steps": times, "wall": time.perf_counter() - t0, "step_cpu": cpu})
    q.put({"runs": out, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


def _single_rank_env() -> dict[str, str]:
    """A one-rank job's torch.distributed environment (a free rendezvous port), set in os.environ."""
    import os

    from orchestrator.rank_tasks import free_port

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port("127.0.0.1"))}
    os.environ.update(env)
    return env


def _rank(rank: int, spec: dict[str, Any], port: int) -> None:
    """Child process: one rank of a multi-rank job (the built-in job's entrypoint, as launched)."""
    import os

    from tracer.job import Session
    from tracer.job_config import JobConfig
    from workloads import train

    env = {"RANK": str(rank), "WORLD_SIZE": str(spec["parallel"]["world_size"]), "LOCAL_RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    os.environ.update(env)
    train.main(Session(JobConfig.from_spec(spec, env=env)))


def _spawn_ranks(spec: dict[str, Any]) -> None:
    """Run a multi-rank job (one process per rank) to completion."""
    import torch.multiprocessing as torch_mp  # multiprocessing has no start_processes

    from orchestrator.rank_tasks import free_port

    torch_mp.start_processes(_rank, args=(spec, free_port("127.0.0.1")),
                             nprocs=int(spec["parallel"]["world_size"]), join=True, start_method="spawn")


def _spawn(specs: list[dict[str, Any]], legacy: bool = False) -> dict[str, Any]:
    return _in_child(_train, specs, legacy=legacy)


def _in_child(target: Any, *args: Any, **kwargs: Any) -> Any:
    """target(*args, q, **kwargs) in a fresh spawned process (its peak RSS is its own); its one result."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q), kwargs=kwargs)
    p.start()
    return _result(p, q)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def overhead(steps: int, tmp: Path) -> dict[str, Any]:
    out = {}
    for model, ov in MODELS.items():
        ov = [*ov, f"steps={steps}"]
        store = tmp / f"overhead-{model}"
        row: dict[str, Any] = {}
        for mode in ("off", "on"):
            res = _spawn([_spec(ov, str(store), mode, trace=mode == "on")])
            st = res["runs"][0]["steps"][1:]   # step 0 pays one-off allocations
            row[mode] = {"step_min_s": min(st), "step_median_s": statistics.median(st),
                         "wall_s": res["runs"][0]["wall"], "peak_rss_mb": res["peak_rss_mb"]}
        on, off = row["on"], row["off"]
        row.update(step_ratio_median=on["step_median_s"] / off["step_median_s"],
                   step_ratio_min=on["step_min_s"] / off["step_min_s"],
                   wall_ratio=on["wall_s"] / off["wall_s"], rss_ratio=on["peak_rss_mb"] / off["peak_rss_mb"],
                   trace_bytes_per_step=_dir_bytes(store / "on") / steps)
        out[model] = row
    return out


GOALS = {"step_time_ratio": 1.3, "stats_mode_step_time_ratio": 1.1}   # issue 16
PAIRED_STEPS = 33   # per process: 4 traced blocks and 4 paused, 3 counted steps each
PAIRED_MODES = ("full", "stats", "hooks_only")
# gpt_tiny's paired figures also hold `no_write` (_train_paired): full mode's records without the files.
PAIRED_DIAGNOSTICS = ("no_write",)
WRITERS = {"off": None, "legacy_full": "full", "full": "full", "stats": "stats"}


# paired_by_model: gpt_tiny and two wider models (4x and 16x the weights of a layer, 2x and 4x its
# activations): the taps' cost per record stays, the step's compute and the bytes per step grow.
PAIRED_MODELS = {"gpt_tiny": [], "hidden=128": ["model.hidden=128", "model.ffn_hidden=512"],
                 "hidden=256": ["model.hidden=256", "model.ffn_hidden=1024"]}


def _paired(overrides: list[str], rounds: int, tmp: Path,
            modes: tuple[str, ...] = PAIRED_MODES) -> dict[str, Any]:
    """Per paired mode, the traced and paused steps' medians and their ratio, over `rounds` processes
    each; and the trace bytes per traced step (full mode)."""
    got: dict[str, dict[str, list[float]]] = {m: {"traced": [], "paused": []} for m in modes}
    written = traced_steps = 0
    for r in range(rounds):
        for mode, g in got.items():
            store = tmp / mode
            spec = _spec([f"steps={PAIRED_STEPS}", *overrides], str(store), f"round{r}")
            spec["trace"]["mode"] = "stats" if mode == "stats" else "full"
            res = _in_child(_train_paired, spec, hooks_only=mode == "hooks_only", no_write=mode == "no_write")
            g["traced"] += res["traced"]
            g["paused"] += res["paused"]
            if mode == "full":
                written += _dir_bytes(store / f"round{r}")
                traced_steps += res["traced_steps"]
    out: dict[str, Any] = {}
    for mode, g in got.items():
        on, off = statistics.median(g["traced"]), statistics.median(g["paused"])
        out[mode] = {"steps_per_kind": len(g["traced"]), "block": PAIRED_BLOCK,
                     "traced_median_s": on, "paused_median_s": off, "step_time_ratio": on / off}
    out["trace_bytes_per_traced_step"] = written / max(traced_steps, 1)
    return out


def tracer_overhead(steps: int, rounds: int, tmp: Path) -> dict[str, Any]:
    """gpt_tiny, one rank: median step time (steps after the first, all rounds pooled) of each writer
    over the untraced one. Each round runs every configuration once, in a fresh process, in turn: a
    load spike on the shared machine then hits every configuration alike."""
    steps_of: dict[str, list[float]] = {w: [] for w in WRITERS}
    rounds_of: dict[str, list[float]] = {w: [] for w in WRITERS}   # each round's median step
    cpu_of: dict[str, list[float]] = {w: [] for w in WRITERS}
    bytes_of: dict[str, int] = {}
    for r in range(rounds):
        for w, mode in WRITERS.items():
            store = tmp / f"tracer-overhead-{w}"
            spec = _spec([f"steps={steps}"], str(store), f"round{r}", trace=mode is not None)
            spec["trace"]["mode"] = mode or "full"
            res = _spawn([spec], legacy=w.startswith("legacy"))["runs"][0]
            steps_of[w] += res["steps"][1:]   # step 0 pays one-off allocations
            rounds_of[w].append(statistics.median(res["steps"][1:]))
            cpu_of[w] += res["step_cpu"][1:]
            bytes_of[w] = _dir_bytes(store / f"round{r}") if mode else 0
    # The same figures, traced and paused steps interleaved in one process: gpt_tiny (the goals'
    # model), then wider ones (a diagnostic: how the costs per record and per byte scale).
    paired = {label: _paired(ov, rounds, tmp / f"tracer-overhead-paired-{i}",
                             PAIRED_MODES + (PAIRED_DIAGNOSTICS if i == 0 else ()))
              for i, (label, ov) in enumerate(PAIRED_MODELS.items())}
    med = {w: statistics.median(v) for w, v in steps_of.items()}
    # The mean beside the median: a full GC pass or a stall on the writer thread is a rare long step
    # that the median ignores and a training run pays.
    row = lambda w: {"step_median_s": med[w], "step_mean_s": statistics.mean(steps_of[w]),
                     "steps_measured": len(steps_of[w]),
                     "step_cpu_median_s": statistics.median(cpu_of[w]),
                     "trace_bytes_per_step": bytes_of[w] / steps}
    out: dict[str, Any] = {"model": "gpt_tiny", "steps": steps, "rounds": rounds, "goals": GOALS,
                           **{w: row(w) for w in WRITERS}}
    out["step_time_ratio"] = {"before": med["legacy_full"] / med["off"], "after": med["full"] / med["off"]}
    # Before this change there was no stats mode: its `before` is the full trace it replaces.
    out["stats_mode_step_time_ratio"] = {"before": med["legacy_full"] / med["off"],
                                         "after": med["stats"] / med["off"]}
    out["paired"], *wider = paired.values()
    out["paired_by_model"] = dict(zip(list(PAIRED_MODELS)[1:], wider, strict=True))
    # Beside each goal's figure (pooled medians), the same ratio round by round: processes of one round
    # run back to back, so its spread shows what the machine's swings do to the pooled figure.
    by_round = lambda w: sorted(a / b for a, b in zip(rounds_of[w], rounds_of["off"], strict=True))
    out["step_time_ratio"]["after_by_round"] = by_round("full")
    out["stats_mode_step_time_ratio"]["after_by_round"] = by_round("stats")
    out["missed"] = [k for k, goal in GOALS.items() if out[k]["after"] > goal]
    return out


def _compare(store: str, runs: list[str], q: Any, tree: str | None = None) -> None:
    """Child process: load and compare one store's runs; report times and the process's peak RSS.
    `tree`: compare with the code of that directory (an exported commit) instead of this tree's."""
    if tree is not None:
        sys.path.insert(0, tree)
    from orchestrator.recipe import compose
    from tracer.compare import compare
    from tracer.logical import load_logical
    from tracer.tolerance import TolerancePolicy

    policy = TolerancePolicy.from_config(compose([])["tolerance"])
    try:   # compiled kernels load once per process, in a check while its jobs run (orchestrator/prefetch.py)
        from tracer.kernels import warm_up
    except ImportError:   # the baseline tree has none
        pass
    else:
        warm_up()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    ref, *pert = (load_logical(store, r, 1, lazy=True) for r in runs[:-1])   # as a check reads them
    cand = load_logical(store, runs[-1], CANDIDATE_RANKS, lazy=True)
    load_s = time.perf_counter() - t0
    res = compare(ref, cand, pert, policy)
    q.put({"load_s": load_s, "compare_total_s": time.perf_counter() - t0, "verdict": res.verdict,
           "tensors": len(res.results), "rss_before_mb": rss0,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


def _compare_in_child(store: str, runs: list[str], tree: str | None) -> dict[str, Any]:
    return _in_child(_compare, store, runs, tree=tree)   # a fresh process per run: its own peak RSS


def _result(p: Any, q: Any, timeout_s: float = 1800) -> Any:
    """A child process's one result; an error if it ends without one (it raised: its traceback is on
    stderr) or runs past timeout_s."""
    import queue

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            out = q.get(timeout=1.0)
            p.join()
            return out
        except queue.Empty:
            if not p.is_alive():
                raise RuntimeError(f"bench child process ended with exit code {p.exitcode} and no result") \
                    from None
            if time.monotonic() > deadline:
                p.kill()
                raise RuntimeError(f"bench child process gave no result within {timeout_s:.0f} s") from None


def _raw_read(store: str) -> tuple[int, float]:
    """Every byte of every part and manifest, through the same fsspec filesystem: (bytes, seconds)."""
    import fsspec

    fs = fsspec.filesystem("file")
    files = [f for f in fs.find(store) if f.endswith((".safetensors", ".json"))]
    t0 = time.perf_counter()
    nbytes = sum(len(fs.cat_file(f)) for f in files)
    return nbytes, time.perf_counter() - t0


COMPARE_GOALS = {"16x": 0.5, "1x": 0.3}   # issue 16: compare throughput / raw read throughput
ROUNDS = 3
COMPARE_BASELINE = "f05498d"   # the comparison before its compiled kernels (tracer/kernels/)


def _exported(commit: str) -> str:
    """The code and recipes of `commit`, exported once into a temporary directory."""
    import subprocess

    path = Path(tempfile.gettempdir()) / f"ttrace-{commit}"
    if not (path / "tracer").is_dir():
        path.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "tracer", "orchestrator",
                                  "workloads", "recipes"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(path)], input=archive, check=True)
    return str(path)


def _scale_store(tmp: Path, label: str, layers: int) -> tuple[str, list[str]]:
    """The reference, R perturbed runs and a tp2 candidate of gpt_tiny at `layers` layers, traced into
    tmp/scale-<label> (once): (the store, its runs, the candidate last)."""
    store = str(tmp / f"scale-{label}")
    runs = ["reference", *(f"perturbed{i}" for i in range(1, R + 1)), "candidate"]
    if not (tmp / f"scale-{label}" / "candidate").is_dir():
        ov = [f"model.layers={layers}"]
        _spawn([_spec(ov, store, "reference"), *(_spec(ov, store, f"perturbed{i}", perturb_seed=i)
                                                  for i in range(1, R + 1))])
        # The candidate is sharded (tp2): the comparison reassembles it, as in a real check.
        _spawn_ranks(_spec(ov, store, "candidate", parallel=CANDIDATE))
    return store, runs


SHARE_WORKERS = (2, 4)


def _compare_shares(store: str, runs: list[str], rounds: int, q: Any) -> None:
    """Child process: the comparison walked by this process, then measured in N Ray tasks of 1 CPU
    (orchestrator/compare_tasks.py) on a local Ray of this machine's cores, interleaved per round;
    and the bytes of parts each of N shares reads (tracer/compare_shares.py)."""
    import ray

    from orchestrator.compare_tasks import measurer
    from orchestrator.recipe import compose
    from tracer.compare import compare
    from tracer.compare_inputs import tensor_keys
    from tracer.compare_shares import RunAt, partition
    from tracer.kernels import warm_up
    from tracer.logical import load_logical
    from tracer.store import world_size_of
    from tracer.tolerance import TolerancePolicy

    ray.init(num_cpus=mp.cpu_count(), include_dashboard=False, log_to_driver=False)
    policy = TolerancePolicy.from_config(compose([])["tolerance"])
    warm_up()
    at = {r: RunAt(store, r, world_size_of(store, r)) for r in runs}
    opened = lambda: [load_logical(store, r, at[r].world_size, lazy=True) for r in runs]
    perturbed = [at[r] for r in runs[1:-1]]
    tasks = lambda n: measurer({}, at[runs[0]], at[runs[-1]], perturbed, n, policy.k_elem)
    how = {"driver": None, **{f"{n} tasks": tasks(n) for n in SHARE_WORKERS}}
    times: dict[str, list[float]] = {k: [] for k in how}
    for _ in range(rounds + 1):   # the first round starts the task workers: not counted
        for label, m in how.items():
            ref, *pert, cand = opened()
            t0 = time.perf_counter()
            verdict = compare(ref, cand, pert, policy, measurer=m).verdict
            times[label].append(time.perf_counter() - t0)
            assert verdict == "pass", (label, verdict)
    traces = opened()
    keys = tensor_keys(traces[0])
    size: dict[tuple[str, int, str], int] = {}   # every part's bytes
    for t in traces:
        for n in t.order:
            for rt, e in t.tensors.pieces(n):
                if (t.run, rt.rank, e["file"]) not in size:
                    size[t.run, rt.rank, e["file"]] = next(int(f["bytes"]) for f in rt.manifest["files"]
                                                           if f["file"] == e["file"])
    part_bytes = lambda names: sum(size[p] for p in {(t.run, rt.rank, e["file"]) for t in traces
                                                     for n in names for rt, e in t.tensors.pieces(n)})
    q.put({"seconds": {k: v[1:] for k, v in times.items()},
           "median_s": {k: statistics.median(v[1:]) for k, v in times.items()},
           "first_round_s": {k: v[0] for k, v in times.items()},
           "parts_bytes": part_bytes([k.name for k in keys]),
           "share_parts_bytes": {str(n): [part_bytes([k.name for k in s]) for s in partition(keys, n)]
                                 for n in SHARE_WORKERS}})
    ray.shutdown()


def compare_shares(tmp: Path, label: str = "16x", rounds: int = 3) -> dict[str, Any]:
    """The comparison in shares on this one machine: what splitting costs where the shares share the
    cores (a diagnostic: its gain needs several nodes, docs/scale.md section 4; no goal)."""
    store, runs = _scale_store(tmp, label, SCALES[label])
    return {"store": label, "cpus": mp.cpu_count(), "task_cpus": 1, "rounds": rounds,
            **_in_child(_compare_shares, store, runs, rounds)}


def compare_scaling(tmp: Path, scales: dict[str, int] = SCALES, rounds: int = ROUNDS,
                    before: str = COMPARE_BASELINE) -> dict[str, Any]:
    """Per size: the comparison `before` (the code of commit `before`, default COMPARE_BASELINE) and
    `after` (this tree's), each in a fresh process, `rounds` times interleaved, each against the raw
    read measured just before it; the medians (by ratio)."""
    baseline = _exported(before)
    out = {}
    for label, layers in scales.items():
        store, runs = _scale_store(tmp, label, layers)
        rows: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
        _raw_read(store)   # untimed: parts written with O_DIRECT are not in the page cache; every round
        for _ in range(rounds):   # then reads them from it, as it did before the writer bypassed it
            for when, tree in (("before", baseline), ("after", None)):
                nbytes, raw_s = _raw_read(store)
                c = _compare_in_child(store, runs, tree)
                gb, cmp_s = nbytes / 1e9, c["compare_total_s"]
                rows[when].append({
                    "layers": layers, "bytes": nbytes, **c, "raw_read_s": raw_s, "raw_gb_s": gb / raw_s,
                    "compare_gb_s": gb / cmp_s, "ratio": raw_s / cmp_s, "s_per_gb": cmp_s / gb,
                    "rss_over_trace": c["peak_rss_mb"] * 2**20 / nbytes})
        median = lambda rs: sorted(rs, key=lambda x: x["ratio"])[len(rs) // 2]
        out[label] = {**median(rows["after"]), "before": median(rows["before"]), "before_commit": before,
                      "ratios": {w: [r["ratio"] for r in rs] for w, rs in rows.items()}}
    return out


def compare_summary(scaling: dict[str, Any]) -> dict[str, Any]:
    ratios = {s: {"before": c["before"]["ratio"], "after": c["ratio"]} for s, c in scaling.items()}
    return {"throughput_ratio_to_raw_read": ratios, "goals": COMPARE_GOALS,
            "missed": [f"compare {s}" for s, goal in COMPARE_GOALS.items()
                       if s in ratios and ratios[s]["after"] < goal]}


LATENCY_GOAL = 1.5   # issue 16: a check's wall time over its longest job, on a warm cluster


def check_latency(tmp: Path, rounds: int = 4) -> dict[str, Any]:
    """The demo check (default recipe, MLflow on) on a warm cluster: Ray started and its workers warm
    (one check run first), every check with a fresh store (the reference jobs run). `before`: the
    comparison as before issue 16 (TTRACE_COMPARE_THREADS=1: chunks one by one with torch's own
    threads, the driver's heap not frozen during the comparison and MLflow logging, and the reference
    set not read while the candidate runs); `after`: as shipped. Interleaved, `rounds` each; the
    medians of total / longest job, and of total (a ratio that falls because the candidate ran longer
    is no gain)."""
    import contextlib
    import os

    import ray

    import orchestrator.check
    from orchestrator.prefetch import ReferencePrefetch

    def one(tag: str) -> dict[str, Any]:
        return _timed_check([], tmp, tag, base_dir=tmp)

    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    try:
        one("warm-up")
        command = command_check_latency(tmp, rounds)
        for i in range(rounds):
            for when in ("before", "after"):
                frozen, poll = orchestrator.check.gc_frozen, ReferencePrefetch.poll
                if when == "before":
                    os.environ["TTRACE_COMPARE_THREADS"] = "1"
                    orchestrator.check.gc_frozen = contextlib.nullcontext   # type: ignore[assignment]
                    ReferencePrefetch.poll = lambda self, *_: None   # type: ignore[method-assign]
                try:
                    runs[when].append(one(f"{when}{i}"))
                finally:
                    os.environ.pop("TTRACE_COMPARE_THREADS", None)
                    orchestrator.check.gc_frozen, ReferencePrefetch.poll = frozen, poll
    finally:
        ray.shutdown()
    ratio = {w: statistics.median(r["ratio"] for r in rs) for w, rs in runs.items()}
    total = {w: statistics.median(r["timings"]["total"] for r in rs) for w, rs in runs.items()}
    missed = ["check_latency"] if ratio["after"] > LATENCY_GOAL else []
    if command["ratio_to_longest_job"]["after"] > LATENCY_GOAL:
        missed.append("check_latency command")
    return {"ratio_to_longest_job": ratio, "total_s": total, "goal": LATENCY_GOAL, "runs": runs,
            "command": command, "missed": missed}


def _timed_check(overrides: list[str], tmp: Path, tag: str, base_dir: Path) -> dict[str, Any]:
    """One check with a fresh store (its reference jobs run): verdict, timings, and its wall time
    over its longest job."""
    from orchestrator.check import run_check
    from orchestrator.recipe import compose

    rec = compose([*overrides, "store.url=" + str(tmp / f"latency-store-{tag}")])
    res = run_check(rec, tmp / f"latency-out-{tag}", base_dir=str(base_dir))
    t = res.report["timings"]
    longest = max(t.get("jobs", {}).values(), default=float("nan"))
    return {"verdict": res.verdict, "timings": t, "total_s": t["total"], "longest_job_s": longest,
            "ratio": t["total"] / longest}


COMMAND_JOB = ["job.command=python examples/ddp_by_hand/train.py", "parallel=dp2"]


def command_check_latency(tmp: Path, rounds: int) -> dict[str, Any]:
    """A user's script as a command job (examples/ddp_by_hand, dp2, R=3, MLflow on) on the warm cluster
    check_latency uses. `before`: each rank a fresh interpreter (job.warm_start=false, as before
    warm_python.py); `after`: forked by the pool's rank host. The first `after` check starts
    the host (`after_first_check_s`, beside the medians of the warm ones); then interleaved,
    `rounds` each, every check with a fresh store."""
    # The script's path is relative to the checkout (the check's base directory).
    one = lambda tag, warm: _timed_check([*COMMAND_JOB, f"job.warm_start={str(warm).lower()}"], tmp,
                                         f"command-{tag}", base_dir=ROOT)
    first = one("first", True)
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for i in range(rounds):
        for when in ("before", "after"):
            runs[when].append(one(f"{when}{i}", when == "after"))
    median = lambda key: {w: statistics.median(r[key] for r in rs) for w, rs in runs.items()}
    return {"job": COMMAND_JOB, "ratio_to_longest_job": median("ratio"), "total_s": median("total_s"),
            "longest_job_s": median("longest_job_s"), "after_first_check_s": first["total_s"],
            "verdicts": sorted({r["verdict"] for rs in runs.values() for r in rs} | {first["verdict"]}),
            "runs": runs}


def end_to_end(tmp: Path) -> dict[str, Any]:
    import ray

    from orchestrator.check import run_check
    from orchestrator.recipe import compose

    rec = compose(["store.url=" + str(tmp / "e2e-store")])   # fresh store: the reference cache misses
    res = run_check(rec, tmp / "e2e-out", base_dir=str(tmp))
    ray.shutdown()
    t = res.report["timings"]
    jobs = t.get("jobs", {})
    return {"verdict": res.verdict, "timings": t, "jobs_sum_s": sum(jobs.values()),
            "jobs_max_s": max(jobs.values(), default=0.0),
            "total_over_jobs_max": t["total"] / max(jobs.values(), default=float("nan")),
            "total_over_jobs_sum": t["total"] / (sum(jobs.values()) or float("nan"))}


def table(r: dict[str, Any]) -> str:
    lines = []
    if "tracer_overhead" in r:
        t = r["tracer_overhead"]
        lines += [f"tracer_overhead (gpt_tiny, 1 rank, {t['rounds']} rounds x {t['steps']} steps; "
                  "median step)",
                  f"{'writer':<13}{'step ms':>9}{'x untraced':>12}{'mean ms':>9}{'step CPU ms':>13}"
                  f"{'trace MB/step':>15}"]
        for w in WRITERS:
            o = t[w]
            ratio = o["step_median_s"] / t["off"]["step_median_s"]
            lines.append(f"{w:<13}{o['step_median_s'] * 1e3:>9.1f}{ratio:>12.2f}"
                         f"{o.get('step_mean_s', math.nan) * 1e3:>9.1f}"
                         f"{o['step_cpu_median_s'] * 1e3:>13.1f}{o['trace_bytes_per_step'] / 1e6:>15.2f}")
        for k, goal in GOALS.items():
            rounds = t[k].get("after_by_round")
            spread = f"; round by round {rounds[0]:.2f}-{rounds[-1]:.2f}" if rounds else ""
            lines.append(f"{k}: before {t[k]['before']:.2f}, after {t[k]['after']:.2f} (goal <= {goal}"
                         f"{spread}){'  MISSED' if k in t['missed'] else ''}")
        for mode, pr in t.get("paired", {}).items():
            if mode in PAIRED_MODES + PAIRED_DIAGNOSTICS:
                lines.append(f"paired in one process, {mode}: traced {pr['traced_median_s'] * 1e3:.1f} ms, "
                             f"paused {pr['paused_median_s'] * 1e3:.1f} ms, x{pr['step_time_ratio']:.2f} "
                             f"({pr['steps_per_kind']} steps each, blocks of {pr['block']})")
        if "paired_by_model" in t:
            lines.append(f"paired by model{'':<6}{'step ms':>9}{'trace MB/step':>15}"
                         + "".join(f"{m + ' x':>14}" for m in PAIRED_MODES))
            for label, pr in {"gpt_tiny": t["paired"], **t["paired_by_model"]}.items():
                lines.append(f"  {label:<19}{pr['full']['paused_median_s'] * 1e3:>9.1f}"
                             f"{pr.get('trace_bytes_per_traced_step', math.nan) / 1e6:>15.1f}"
                             + "".join(f"{pr[m]['step_time_ratio']:>14.2f}" for m in PAIRED_MODES))
        lines.append("")
    lines += ["tracer overhead (single rank, gloo, CPU; steps after the first)",
             f"{'model':<13}{'step off ms':>12}{'step on ms':>12}{'step x':>8}{'wall x':>8}"
             f"{'RSS off MB':>11}{'RSS on MB':>10}{'RSS x':>7}{'trace MB/step':>15}"]
    for m, o in r.get("overhead", {}).items():
        lines.append(f"{m:<13}{o['off']['step_median_s'] * 1e3:>12.1f}{o['on']['step_median_s'] * 1e3:>12.1f}"
                     f"{o['step_ratio_median']:>8.2f}{o['wall_ratio']:>8.2f}{o['off']['peak_rss_mb']:>11.0f}"
                     f"{o['on']['peak_rss_mb']:>10.0f}{o['rss_ratio']:>7.2f}"
                     f"{o['trace_bytes_per_step'] / 1e6:>15.2f}")
    lines += ["", "comparison (reference + 3 perturbed + a tp2 candidate, local store)",
              f"{'size':<5}{'layers':>7}{'MB':>8}{'tensors':>8}{'raw GB/s':>10}{'load s':>8}{'compare s':>10}"
              f"{'cmp GB/s':>9}{'ratio':>7}{'s/GB':>8}{'peak RSS MB':>12}"]
    for s, c in r.get("scaling", {}).items():
        lines.append(f"{s:<5}{c['layers']:>7}{c['bytes'] / 1e6:>8.1f}{c['tensors']:>8}{c['raw_gb_s']:>10.2f}"
                     f"{c['load_s']:>8.2f}{c['compare_total_s']:>10.2f}{c['compare_gb_s']:>9.3f}"
                     f"{c['ratio']:>7.3f}{c['s_per_gb']:>8.1f}{c.get('peak_rss_mb', 0):>12.0f}")
    if "compare" in r:
        for size, v in r["compare"]["throughput_ratio_to_raw_read"].items():
            goal = COMPARE_GOALS.get(size)
            commit = r.get("scaling", {}).get(size, {}).get("before_commit", COMPARE_BASELINE)
            lines.append(f"compare.throughput_ratio_to_raw_read {size}: before ({commit}) {v['before']:.3f}, "
                         f"after {v['after']:.3f}" + (f" (goal >= {goal})" if goal else "")
                         + ("  MISSED" if f"compare {size}" in r["compare"]["missed"] else ""))
    if "error" in r.get("compare_shares", {}):
        lines += ["", f"comparison in Ray tasks: not measured ({r['compare_shares']['error'][:200]})"]
    elif "compare_shares" in r:
        c = r["compare_shares"]
        lines += ["", f"comparison in Ray tasks of {c['task_cpus']} CPU on this {c['cpus']}-core machine "
                  f"({c['store']}, {c['parts_bytes'] / 1e6:.0f} MB of parts; median of {c['rounds']} rounds)"]
        lines += [f"{k:<9} {v:.2f} s" + (f"  (each share reads "
                  f"{', '.join(f'{b / 1e6:.0f}' for b in c['share_parts_bytes'][k.split()[0]])} MB)"
                  if k != "driver" else "") for k, v in c["median_s"].items()]
    if "error" in r.get("check_latency", {}):
        lines += ["", f"check latency: not measured ({r['check_latency']['error'][:200]})"]
    elif "check_latency" in r:
        c = r["check_latency"]
        lines += ["", "demo check on a warm cluster (Ray up, workers warm, fresh store), seconds"]
        for when, rs in c["runs"].items():
            for x in rs:
                t = x["timings"]
                lines.append(f"{when:<7} total {t['total']:.2f}  longest job {x['longest_job_s']:.2f}  "
                             f"jobs_wall {t.get('jobs_wall', 0):.2f}  compare {t.get('compare', 0):.2f}  "
                             f"tracking {t.get('tracking', 0):.2f}  ratio {x['ratio']:.2f}")
        v = c["ratio_to_longest_job"]
        lines.append(f"check_latency.ratio_to_longest_job: before {v['before']:.2f}, after {v['after']:.2f} "
                     f"(goal <= {c['goal']}){'  MISSED' if 'check_latency' in c['missed'] else ''}")
        if "total_s" in c:
            lines.append(f"check wall time (median): before {c['total_s']['before']:.2f} s, "
                         f"after {c['total_s']['after']:.2f} s")
        if "command" in c:
            k = c["command"]
            lines += ["", f"a user's script ({' '.join(k['job'])}), fresh interpreters (before) or forked "
                      f"warm (after), medians; verdicts {k['verdicts']}",
                      f"check wall time: before {k['total_s']['before']:.2f} s, after "
                      f"{k['total_s']['after']:.2f} s (first check, the rank host starting: "
                      f"{k['after_first_check_s']:.2f} s)",
                      f"longest job: before {k['longest_job_s']['before']:.2f} s, after "
                      f"{k['longest_job_s']['after']:.2f} s",
                      "check_latency.command.ratio_to_longest_job: before "
                      f"{k['ratio_to_longest_job']['before']:.2f}, after "
                      f"{k['ratio_to_longest_job']['after']:.2f} (goal <= {c['goal']})"
                      f"{'  MISSED' if 'check_latency command' in c['missed'] else ''}"]
    if "e2e_error" in r:
        lines += ["", f"demo check end to end: not measured ({r['e2e_error'][:200]})"]
    if "e2e" in r:
        e, t = r["e2e"], r["e2e"]["timings"]
        jobs = ", ".join(f"{k} {v:.1f}" for k, v in t.get("jobs", {}).items())
        lines += ["", f"demo check end to end ({e['verdict']}), seconds",
                  f"ray_start {t.get('ray_start', 0):.1f}  jobs_wall {t.get('jobs_wall', 0):.1f}  "
                  f"compare {t.get('compare', 0):.1f}  tracking {t.get('tracking', 0):.1f}  "
                  f"total {t['total']:.1f}",
                  f"jobs: {jobs}",
                  f"total / longest job {e['total_over_jobs_max']:.2f}   "
                  f"total / sum of jobs {e['total_over_jobs_sum']:.2f}"]
    return "\n".join(lines)


def _stamp() -> dict[str, str]:
    """When, at which commit and on what a section was measured: an --only run adds its sections to an
    existing perf.json, so each section says which run it comes from."""
    import platform
    import subprocess

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": git("rev-parse", "--short", "HEAD") + dirty,
            "machine": f"{model}, {mp.cpu_count()} cpus"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--rounds", type=int, default=3, help="tracer_overhead: rounds of all writers")
    ap.add_argument("--only-tracer-overhead", action="store_true",
                    help="measure only tracer_overhead and add it to the existing bench/perf.json")
    ap.add_argument("--only-e2e", action="store_true",
                    help="measure only the demo check and add it to the existing bench/perf.json")
    ap.add_argument("--only-compare", action="store_true",
                    help="measure only the comparison (before/after), added to bench/perf.json")
    ap.add_argument("--only-check-latency", action="store_true",
                    help="measure only the warm-cluster check latency, added to bench/perf.json")
    ap.add_argument("--only-compare-shares", action="store_true",
                    help="measure only the comparison in Ray tasks on this machine (a diagnostic)")
    ap.add_argument("--scales", default=",".join(SCALES), help="comparison sizes, e.g. 1x,16x")
    ap.add_argument("--compare-rounds", type=int, default=ROUNDS)
    ap.add_argument("--compare-before", default=COMPARE_BASELINE,
                    help="the commit whose comparison is `before` (default: the last before the kernels)")
    args = ap.parse_args()
    only = (args.only_e2e or args.only_compare or args.only_check_latency or args.only_tracer_overhead
            or args.only_compare_shares)
    scales = {s: SCALES[s] for s in args.scales.split(",")}
    result: dict[str, Any] = {"cpus": mp.cpu_count(), "steps": args.steps}
    if only and OUT.exists():
        result = json.loads(OUT.read_text())
        result.pop("e2e_error", None)
    stamp = _stamp()
    result["measured"] = {**result.get("measured", {}), "last_run": stamp}
    with tempfile.TemporaryDirectory(prefix="ttrace-perf-") as d:
        tmp = Path(d)
        if not only or args.only_tracer_overhead:
            result["tracer_overhead"] = tracer_overhead(args.steps, args.rounds, tmp)
            result["measured"]["tracer_overhead"] = stamp
            OUT.write_text(json.dumps(result, indent=1, default=str))
        if not only:
            result["overhead"] = overhead(args.steps, tmp)
            result["measured"]["overhead"] = stamp
            OUT.write_text(json.dumps(result, indent=1, default=str))   # partial results survive a failure
        if not only or args.only_compare:
            result["scaling"] = compare_scaling(tmp, scales, args.compare_rounds, args.compare_before)
            result["compare"] = compare_summary(result["scaling"])
            result["measured"]["compare"] = stamp
            OUT.write_text(json.dumps(result, indent=1, default=str))
        if not only or args.only_compare_shares:
            try:   # a diagnostic: Ray failing to start here must not lose the other figures
                result["compare_shares"] = compare_shares(tmp)
            except Exception as e:
                result["compare_shares"] = {"error": f"{type(e).__name__}: {e}"}
            result["measured"]["compare_shares"] = stamp
            OUT.write_text(json.dumps(result, indent=1, default=str))
        if not only or args.only_check_latency:
            try:
                result["check_latency"] = check_latency(tmp)
            except Exception as e:   # e.g. Ray failing to start on an overloaded machine
                result["check_latency"] = {"error": f"{type(e).__name__}: {e}", "missed": ["check_latency"]}
            result["measured"]["check_latency"] = stamp
            OUT.write_text(json.dumps(result, indent=1, default=str))
        if (not only and not args.skip_e2e) or args.only_e2e:
            try:
                result["e2e"] = end_to_end(tmp)
                result["measured"]["e2e"] = stamp
            except Exception as e:   # e.g. Ray failing to start on an overloaded machine
                result["e2e_error"] = f"{type(e).__name__}: {e}"
    OUT.write_text(json.dumps(result, indent=1, default=str))
    print(table(result))
    print(f"\nwrote {OUT.relative_to(ROOT)}")
    # Judged: what this run measured (an --only run keeps the file's other sections, not their verdicts).
    measured = {"tracer_overhead": args.only_tracer_overhead, "compare": args.only_compare,
                "check_latency": args.only_check_latency}
    missed = [m for section, now in measured.items() if now or not only
              for m in result.get(section, {}).get("missed", [])]
    if missed:
        print(f"goal missed: {', '.join(missed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
