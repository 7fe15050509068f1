"""report.html: one self-contained page per check (inline SVG, CSS and JS; nothing fetched).

Top: the verdict and the first divergence. Then the divergence profile, one log-scale panel per
phase (forward, backward, after the optimizer step): each tensor's relative error as a dot (red when
beyond tolerance) against its tolerance (line), the first divergence marked. Then a sortable table of
every tensor, built by the inline script from the embedded JSON.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from orchestrator.report.scan_report import panel as scan_panel

PHASES = (("forward", ("output", "loss")), ("backward", ("grad_output", "param_grad")),
          ("after optimizer step", ("param",)))
COLUMNS = ("index", "name", "module_type", "kind", "rel_err", "tolerance", "ratio", "max_err", "cosine",
           "replica_err", "ok")
W, H, PAD_L, PAD_R, PAD_T, PAD_B = 960, 240, 64, 16, 24, 34
FLOOR = 1e-18


def _y(v: float, lo: float, hi: float) -> float:
    v = min(max(v, 10 ** lo), 10 ** hi)
    return PAD_T + (hi - math.log10(v)) / (hi - lo) * (H - PAD_T - PAD_B)


def _panel(title: str, ts: list[dict[str, Any]], first: str | None, culprit: str | None = None) -> str:
    if not ts:
        return ""
    # The axis spans the nonzero errors and the tolerances; exact zeros sit on the bottom line ("0").
    vals = [t["rel_err"] for t in ts if 0 < t["rel_err"] and math.isfinite(t["rel_err"])]
    vals += [t["tolerance"] for t in ts if t["tolerance"] > 0] or [1.0]
    lo = math.floor(math.log10(max(min(vals), FLOOR))) - 1
    hi = math.ceil(math.log10(max(vals))) + (1 if max(vals) == min(vals) else 0)
    hi = max(hi, lo + 1)
    n = len(ts)
    x = lambda i: PAD_L + (i + 0.5) / n * (W - PAD_L - PAD_R)
    out = [f'<svg class="plot" data-phase="{html.escape(title)}" viewBox="0 0 {W} {H}" width="100%" '
           f'xmlns="http://www.w3.org/2000/svg" role="img"><title>{html.escape(title)}: rel_err vs '
           'tolerance (log scale)</title>',
           f'<text x="{PAD_L}" y="15" class="ptitle">{html.escape(title)}</text>']
    for e in range(lo, hi + 1):
        y, label = _y(10 ** e, lo, hi), "0" if e == lo else f"1e{e}"
        out.append(f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
                   f'<text x="{PAD_L - 6}" y="{y + 4:.1f}" class="ytick">{label}</text>')
    tol = " ".join(f"{x(i):.1f},{_y(t['tolerance'], lo, hi):.1f}" for i, t in enumerate(ts))
    out.append(f'<polyline points="{tol}" class="tol"/>')
    for i, t in enumerate(ts):
        err = t["rel_err"] if math.isfinite(t["rel_err"]) else 10 ** hi
        cls = "dot" if t["ok"] else "dot bad"
        if t["name"] == first:
            out.append(f'<line x1="{x(i):.1f}" x2="{x(i):.1f}" y1="{PAD_T}" y2="{H - PAD_B}" class="first"/>'
                       f'<text x="{min(x(i) + 4, W - 260):.1f}" y="{PAD_T + 12}" class="firstlabel">'
                       f'first divergence: {html.escape(t["name"])}</text>')
            cls += " firstdot"
        if t["name"] == culprit and culprit != first:
            out.append(f'<line x1="{x(i):.1f}" x2="{x(i):.1f}" y1="{PAD_T}" y2="{H - PAD_B}" '
                       'class="culpritline"/>'
                       f'<text x="{min(x(i) + 4, W - 260):.1f}" y="{PAD_T + 26}" class="culpritlabel">'
                       f'culprit: {html.escape(t["name"])}</text>')
        out.append(f'<circle cx="{x(i):.1f}" cy="{_y(max(err, FLOOR), lo, hi):.1f}" r="2.6" class="{cls}">'
                   f'<title>{html.escape(t["name"])}: rel_err {t["rel_err"]:.3g}, tol {t["tolerance"]:.3g}'
                   '</title></circle>')
    out.append(f'<text x="{W / 2:.0f}" y="{H - 8}" class="xlabel">tensor (execution order)</text></svg>')
    return "".join(out)


def _logs(report: dict[str, Any]) -> str:
    """Links to every rank's stdout and stderr (relative to this page, in the check directory)."""
    logs = report.get("logs") or {}
    if not logs:
        return ""
    link = lambda path: f'<a href="{html.escape(path)}">{html.escape(path.rsplit("/", 1)[-1])}</a>'
    items = " &middot; ".join(f"{html.escape(run)}: " + ", ".join(link(p) for p in paths)
                              for run, paths in logs.items())
    return f'<p id="logs">rank logs (stdout and stderr) &mdash; {items}</p>'


def render(report: dict[str, Any]) -> str:
    rec = report.get("recipe", {})
    tensors = report.get("tensors", [])
    fd = report.get("first_divergence")
    first = fd["name"] if fd else None
    c = report.get("culprit") or {}
    culprit = c.get("name") if c.get("resolved") else None
    job = (report.get("job") or {}).get("label", "builtin")
    what = (f"job={job} " if job != "builtin" else "") + \
        f"parallel={rec.get('parallel', {}).get('name')} bug={rec.get('bug', {}).get('name')}"
    verdict = report.get("verdict", "error")
    ref = report.get("reference") or {}
    if verdict == "error":
        headline = f"ERROR: {html.escape(report.get('error', ''))}"
    elif fd:
        headline = (f"FAIL: first divergence <b>{html.escape(fd['name'])}</b> in module "
                    f"<b>{html.escape(fd['module'])}</b> ({html.escape(fd['module_type'] or fd['kind'])}): "
                    f"{html.escape(fd['reason'])}")
        from orchestrator.report.text import describe

        if describe(report):
            headline += f'<br><span class="culprit">{html.escape(describe(report))}</span>'
    else:
        headline = f"PASS: {len(tensors)} tensors within tolerance"
    panels = "".join(_panel(title, [t for t in tensors if t["kind"] in kinds], first, culprit)
                     for title, kinds in PHASES)
    rows = [{c: t.get(c) for c in COLUMNS if c != "ratio"} |
            {"ratio": (t["rel_err"] / t["tolerance"]) if t["tolerance"] else 0.0} for t in tensors]
    data = _json_for_js(rows).replace("</", "<\\/")
    head = "".join(f'<th data-col="{c}">{c}</th>' for c in COLUMNS)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ttrace {html.escape(what)}: {verdict}</title>
<style>
body{{font:14px system-ui,sans-serif;margin:20px;color:#222}} h1{{font-size:20px}}
.v-pass{{color:#176f2c}} .v-fail{{color:#b3261e}} .v-error{{color:#8a5a00}}
.plot{{border:1px solid #ddd;margin:6px 0;max-width:{W}px;display:block}}
.grid{{stroke:#eee}} .ytick{{font-size:10px;text-anchor:end;fill:#666}}
.ptitle{{font-weight:bold;font-size:12px}}
.xlabel{{font-size:10px;fill:#666;text-anchor:middle}} .tol{{fill:none;stroke:#888;stroke-width:1.2}}
.dot{{fill:#2a6fdb}} .bad{{fill:#d93025}} .firstdot{{stroke:#000;stroke-width:1.5;r:4}}
.first{{stroke:#d93025;stroke-dasharray:4 3}} .firstlabel{{font-size:11px;fill:#d93025}}
.culpritline{{stroke:#7b1fa2;stroke-dasharray:2 2}} .culpritlabel{{font-size:11px;fill:#7b1fa2}}
.culprit{{color:#7b1fa2}} .legend{{font-size:10px}}
table{{border-collapse:collapse;font-size:12px}} td,th{{border:1px solid #ddd;padding:2px 6px}}
th{{cursor:pointer;background:#f4f4f4}} tr.bad td{{background:#fde8e6}} tr.firstrow td{{font-weight:bold}}
</style></head><body>
<h1>ttrace check {html.escape(str(report.get("check_id", "")))} &mdash; {html.escape(what)}</h1>
<p class="v-{verdict}" id="headline">{headline}</p>
<p>reference cache: {html.escape(str(ref.get("cache", "-")))} (key {html.escape(str(ref.get("key", "-")))})
&middot; precision {html.escape(str(rec.get("precision", {}).get("name")))} &middot; steps {rec.get("steps")}
&middot; R = {rec.get("tolerance", {}).get("perturbations")}</p>
{f'<p>reference layout: {html.escape(ref["trusted"])}</p>' if ref.get("trusted") else ""}
{_logs(report)}
{scan_panel(report)}
<h2>Divergence profile (relative error, dots; tolerance, line; log scale)</h2>
<div id="plots">{panels}</div>
<h2>Tensors <small>(click a header to sort)</small></h2>
<table id="tensors"><thead><tr>{head}</tr></thead><tbody></tbody></table>
<script type="application/json" id="data">{data}</script>
<script>
(function() {{
  var rows = JSON.parse(document.getElementById("data").textContent), first = {json.dumps(first)};
  var body = document.querySelector("#tensors tbody"), cols = {json.dumps(list(COLUMNS))}, dir = {{}};
  function fmt(v) {{ return typeof v === "number" && !Number.isInteger(v) ? v.toPrecision(3) : String(v); }}
  function draw() {{
    body.innerHTML = "";
    rows.forEach(function(r) {{
      var tr = document.createElement("tr");
      if (!r.ok) tr.className = "bad";
      if (r.name === first) tr.className += " firstrow";
      cols.forEach(function(c) {{
        var td = document.createElement("td"); td.textContent = fmt(r[c]); tr.appendChild(td);
      }});
      body.appendChild(tr);
    }});
  }}
  document.querySelectorAll("#tensors th").forEach(function(th) {{
    th.addEventListener("click", function() {{
      var c = th.dataset.col, d = dir[c] = -(dir[c] || -1);
      rows.sort(function(a, b) {{ return (a[c] > b[c] ? 1 : a[c] < b[c] ? -1 : 0) * d; }});
      draw();
    }});
  }});
  draw();
  document.body.setAttribute("data-rendered", rows.length);
}})();
</script></body></html>
"""


_INF = "__ttrace_inf__"


def _json_for_js(rows: list[dict[str, Any]]) -> str:
    """`rows` as JSON that the page's JSON.parse takes: an infinite figure (a tensor the candidate never
    produced, a shape mismatch) written as 1e999, which parses to Infinity and sorts as a number, a NaN
    as "nan". Python's Infinity and NaN tokens are not JSON: JSON.parse threw on them and the table was
    left empty."""
    def finite(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return "nan" if math.isnan(v) else ("" if v > 0 else "-") + _INF
        return v
    text = json.dumps([{k: finite(v) for k, v in r.items()} for r in rows], default=str, allow_nan=False)
    return text.replace(f'"-{_INF}"', "-1e999").replace(f'"{_INF}"', "1e999")


def write_html(report: dict[str, Any], path: Path) -> Path:
    path.write_text(render(report))
    return path
