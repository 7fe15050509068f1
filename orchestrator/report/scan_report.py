"""A scan's per-step view (report.json `scan.steps`, orchestrator/scan.py): the report.html panel (each
module's fingerprint error over its band across steps, and the loss gap against the perturbed runs'
spread; inline SVG) and the MLflow metrics logged per step, so drift is a chart."""

from __future__ import annotations

import html
import math
from typing import Any

W, H, PAD_L, PAD_R, PAD_T, PAD_B = 960, 260, 64, 150, 24, 34
MAX_POINTS = 500     # per line: longer scans are shown as the max over bins of steps
LO = 1e-4            # floor of the err/tol axis


def _bins(steps: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    n = len(steps)
    size = max(1, math.ceil(n / MAX_POINTS))
    return [steps[i:i + size] for i in range(0, n, size)]


def _svg(title: str, lines: list[tuple[str, list[tuple[int, float]], str]], x0: int, x1: int,
         mark: int | None, ylabel: str, edge: float | None = None) -> str:
    vals = [v for _, pts, _ in lines for _, v in pts if v > 0 and math.isfinite(v)] or [1.0]
    lo = math.floor(math.log10(max(min(vals), LO)))
    hi = max(math.ceil(math.log10(max(max(vals), edge or 0.0, 10 ** (lo + 1)))), lo + 1)
    x = lambda s: PAD_L + (s - x0) / max(1, x1 - x0) * (W - PAD_L - PAD_R)
    y = lambda v: PAD_T + (hi - math.log10(min(max(v, 10 ** lo), 10 ** hi))) / (hi - lo) * (H - PAD_T - PAD_B)
    out = [f'<svg class="plot" data-panel="{html.escape(title)}" viewBox="0 0 {W} {H}" width="100%" '
           f'xmlns="http://www.w3.org/2000/svg" role="img"><title>{html.escape(title)}</title>',
           f'<text x="{PAD_L}" y="15" class="ptitle">{html.escape(title)}</text>']
    for e in range(lo, hi + 1):
        ye = y(10 ** e)
        out.append(f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{ye:.1f}" y2="{ye:.1f}" class="grid"/>'
                   f'<text x="{PAD_L - 6}" y="{ye + 4:.1f}" class="ytick">1e{e}</text>')
    if edge is not None:
        out.append(f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{y(edge):.1f}" y2="{y(edge):.1f}" class="tol"/>')
    if mark is not None:
        xm = x(mark)
        out.append(f'<line x1="{xm:.1f}" x2="{xm:.1f}" y1="{PAD_T}" y2="{H - PAD_B}" class="first"/>'
                   f'<text x="{min(xm + 4, W - PAD_R - 120):.1f}" y="{PAD_T + 12}" class="firstlabel">'
                   f'first step out of the band: {mark}</text>')
    for i, (label, pts, color) in enumerate(lines):
        if not pts:
            continue
        path = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.2">'
                   f'<title>{html.escape(label)}</title></polyline>')
        if i < 14:
            out.append(f'<text x="{W - PAD_R + 6}" y="{PAD_T + 10 + 12 * i}" class="legend" fill="{color}">'
                       f'{html.escape(label[:24])}</text>')
    out.append(f'<text x="{(W - PAD_R + PAD_L) / 2:.0f}" y="{H - 8}" class="xlabel">step ({x0}..{x1}); '
               f'{html.escape(ylabel)}</text></svg>')
    return "".join(out)


def panel(report: dict[str, Any]) -> str:
    """The per-step section of report.html ('' for a report without a scan)."""
    scan = report.get("scan")
    if not scan or not scan.get("steps"):
        return ""
    steps = scan["steps"]
    bins = _bins(steps)
    x0, x1 = steps[0]["step"], steps[-1]["step"]
    modules = list(dict.fromkeys(m for s in steps for m in s["modules"]))
    color = lambda i: f"hsl({(i * 137) % 360},65%,42%)"
    lines = [(m, [(b[-1]["step"], max(s["modules"].get(m, 0.0) for s in b)) for b in bins], color(i))
             for i, m in enumerate(modules)]
    first = scan.get("first_step")
    parts = [_svg("fingerprint error over its band, per module (max over its tensors; line: the band's edge)",
                  lines, x0, x1, first, "err / tolerance, log scale", edge=1.0)]
    loss = [s for s in steps if s.get("loss")]
    if loss:
        lb = _bins(loss)
        moved = lambda s: abs(s["loss"]["candidate"] - s["loss"]["reference"])
        gap = [(b[-1]["step"], max(moved(s) for s in b)) for b in lb]
        spread = [(b[-1]["step"], max(s["loss"]["spread"] for s in b)) for b in lb]
        parts.append(_svg("loss: |candidate - reference| against the perturbed runs' spread", [
            ("|candidate - reference|", gap, "#d93025"), ("perturbed spread", spread, "#888")],
            x0, x1, first, "absolute loss difference, log scale"))
    rr = scan.get("rerun") or {}
    note = (f"<p>rerun of steps {rr.get('steps')} in full: {html.escape(str(rr.get('verdict')))}"
            f"{' (' + html.escape(rr['error']) + ')' if rr.get('error') else ''}"
            f"{' &mdash; ' + html.escape(rr['note']) if rr.get('note') else ''}</p>") if rr else ""
    return (f'<h2>Scan: {len(steps)} steps</h2><p id="scanline">{html.escape(scan.get("line", ""))}</p>'
            f'{note}<div id="scan">{"".join(parts)}</div>')


def metrics(report: dict[str, Any]) -> list[tuple[str, float, int]]:
    """(name, value, step) per scanned step >= 0: the worst err/tol, per kind, and the loss gap and
    spread; MLflow draws each as a curve over the steps."""
    out: list[tuple[str, float, int]] = []
    for s in (report.get("scan") or {}).get("steps", []):
        step = int(s["step"])
        if step < 0:
            continue
        out.append(("scan.err_over_tol", float(s["worst"]), step))
        out += [(f"scan.err_over_tol.{k}", float(v), step) for k, v in s["kinds"].items()]
        if s.get("loss"):
            out.append(("scan.loss_gap", abs(s["loss"]["candidate"] - s["loss"]["reference"]), step))
            out.append(("scan.loss_spread", float(s["loss"]["spread"]), step))
    return out
