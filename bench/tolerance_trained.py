"""Optional stage of the tolerance benchmark (`bench/tolerance.py --trained STEPS`): do the tolerances
hold on trained weights and real token statistics?

1. Real token statistics within gpt_tiny's vocab of 128: the bytes of this repository's own text
   (README, docs, sources; ASCII only), as a uint16 token file.
2. A checkpoint trained STEPS steps on it: the built-in trainer on one device, in this process and
   untraced, saved as a reference saves (`checkpoint.save`).
3. Clean checks from it (`init.checkpoint`, `data.path`) for every precision and parallel recipe:
   false positives, and the head-room (tolerance / clean error, min and median over tensors).
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PARALLELS = ("tp2", "tp2_sp", "dp2", "pp2", "tp2_pp2", "tp2_dp2")


def text_tokens(path: Path) -> int:
    """Byte-level tokens of the repository's text; returns how many."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for pkg in ("tracer", "workloads", "orchestrator"):
        files += sorted((ROOT / pkg).rglob("*.py"))
    ids = np.frombuffer(b"\n".join(f.read_bytes() for f in files), dtype=np.uint8)
    ids = ids[ids < 128].astype(np.uint16)
    ids.tofile(path)
    return int(ids.size)


class _Untraced:
    """A tracer that records nothing: the training run that makes the checkpoint is not a check."""

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: contextlib.nullcontext()


def train_checkpoint(directory: Path, steps: int, precision: str, data: Path | None, seed: int) -> None:
    """Train `steps` steps on one device on the token file `data` (None: synthetic tokens), save."""
    from orchestrator import recipe
    from tracer.job import Session
    from tracer.job_config import JobConfig
    from workloads.train import main

    rec = recipe.compose([f"precision={precision}", "parallel=single", f"steps={steps}", f"seed={seed}",
                          f"checkpoint.save={directory}", "tracking.enabled=false",
                          *([f"data.path={data}"] if data else [])])
    spec = recipe.job_spec(rec, role="reference", store_url=str(directory) + "-untraced")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    os.environ.update(env)
    main(Session(JobConfig.from_spec(spec, env=env), tracer_factory=lambda *a: _Untraced()))


def run(store: Path, steps: int, precisions: tuple[str, ...], seed: int,
        ratio_summary: Any) -> dict[str, Any]:
    """The stage (module doc); `ratio_summary` is tolerance.py's."""
    from orchestrator import recipe
    from orchestrator.check import run_checks
    from tracer.checkpoint import INDEX

    store.mkdir(parents=True, exist_ok=True)
    data = store / "text_tokens.bin"
    n_tokens = text_tokens(data)
    items = []
    for prec in precisions:
        ck = store / f"trained-{prec}-{steps}-s{seed}"
        if not (ck / INDEX).exists():
            print(f"bench: training {prec} {steps} steps -> {ck}", flush=True)
            train_checkpoint(ck, steps, prec, data, seed)
        for par in PARALLELS:
            rec = recipe.compose([f"precision={prec}", f"parallel={par}", f"seed={seed}",
                                  f"init.checkpoint={ck}", f"data.path={data}", "tracking.enabled=false",
                                  "localize=false", f"store.url={store / 'runs'}"])
            items.append((rec, store / "out" / f"{prec}-{par}"))
    print(f"bench: {len(items)} clean checks from trained checkpoints", flush=True)
    results = run_checks(items, str(ROOT))
    verdicts, ratios = [], {}
    for (rec, _), res in zip(items, results, strict=True):
        prec, par = rec["precision"]["name"], rec["parallel"]["name"]
        ts = res.report.get("tensors") or []
        first = res.report.get("first_divergence") or {}
        verdicts.append({"precision": prec, "parallel": par, "verdict": res.verdict, "tensors": len(ts),
                         "first_divergence": first.get("name"), "error": res.message[:300] or None})
        r = ratios.setdefault(prec, {"norm": [], "elem": []})
        r["norm"] += [t["tolerance"] / t["rel_err"] for t in ts if t.get("rel_err")]
        r["elem"] += [t["elem_tolerance"] / t["elem_err"] for t in ts if t.get("elem_err")]
    return {"steps": steps, "seed": seed, "tokens": n_tokens, "checks": len(verdicts),
            "false_positives": sum(v["verdict"] == "fail" for v in verdicts),
            "errors": sum(v["verdict"] == "error" for v in verdicts), "verdicts": verdicts,
            "tolerance_over_clean_error": {p: {k: ratio_summary(v) for k, v in r.items()}
                                           for p, r in ratios.items()}}


def print_table(res: dict[str, Any]) -> None:
    print(f"\nfrom a checkpoint trained {res['steps']} steps on {res['tokens']} text tokens: {res['checks']} "
          f"clean checks, false positives {res['false_positives']}, errors {res['errors']}")
    for v in res["verdicts"]:
        if v["verdict"] != "pass":
            print(f"  {v['verdict'].upper()} {v['precision']} {v['parallel']}: "
                  f"{v['first_divergence'] or v['error']}")
    for prec, r in res["tolerance_over_clean_error"].items():
        n, e = r["norm"], r["elem"]
        print(f"  {prec:5s} head-room (tolerance / clean error): norm min {n.get('min', math.nan):.1f} "
              f"median {n.get('median', math.nan):.1f} | elem min {e.get('min', math.nan):.1f} "
              f"median {e.get('median', math.nan):.1f}")
