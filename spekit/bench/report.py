"""One self-contained HTML page (tables and plots, images embedded as base64): readable offline, no scripts."""
from __future__ import annotations

import base64
import html
import json
from pathlib import Path

STYLE = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}table{border-collapse:collapse;"
         "font-size:13px;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}"
         "th:first-child,td:first-child{text-align:left}img{max-width:100%}code{background:#f3f3f3}")


def cell(r: dict) -> str:
    parts = [f"{r['tok_s']:.1f} tok/s"]
    if r.get("speedup") is not None:
        spread = r.get("speedup_interval")
        parts.append(f"{r['speedup']:.2f}x" + (f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread else ""))
    if r.get("speedup_vs_hf_plain") is not None:
        parts.append(f"{r['speedup_vs_hf_plain']:.2f}x HF")
    if r.get("tau") is not None:
        parts.append(f"&tau; {r['tau']:.2f}")
    if r.get("identical") is not None:
        parts.append(f"{r['identical']:.0%} same")
    if r.get("identical_to_own_plain") is not None:
        parts.append(f"{r['identical_to_own_plain']:.0%} same as its own plain")
    return "<br>".join(parts)


def table(report: dict) -> str:
    cats = report["categories"]
    rows = ["<tr><th>method</th>" + "".join(f"<th>{html.escape(c)}</th>" for c in cats) + "</tr>"]
    for name, row in report["results"].items():
        rows.append(f"<tr><td>{html.escape(name)}</td>" + "".join(f"<td>{cell(row[c])}</td>" for c in cats)
                    + "</tr>")
    skipped = "".join(f"<li>{html.escape(n)}: {html.escape(w)}</li>" for n, w in report.get("skipped", {}).items())
    s = html.escape(json.dumps(report.get("settings", {})))
    return (f"<p>settings: <code>{s}</code>; {report['questions']} questions</p><table>{''.join(rows)}</table>"
            + (f"<p>skipped:</p><ul>{skipped}</ul>" if skipped else ""))


def write_html(record: dict, plots: list[dict], folder: Path, path: Path) -> None:
    from ..config import write_atomic
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>spekit bench</title><style>{STYLE}</style>"
             "</head><body><h1>spekit bench</h1>",
             f"<p>command: <code>{html.escape(record.get('command', ''))}</code></p>",
             "<p>Cells: tok/s, speedup over spekit plain (in brackets: where 90% of the speedups fall when the "
             "questions are resampled, paired with plain's), over Hugging Face plain, &tau; (tokens per target "
             "forward), share of answers identical to spekit plain (a peer's also to its own engine's plain).</p>",
             "<h2>All methods and peers</h2>", table(record["base"])]
    for p in plots:
        data = base64.b64encode((folder / p["file"]).read_bytes()).decode()
        parts.append(f"<h2>{html.escape(p['title'])}</h2><p>{html.escape(p['caption'])}</p>"
                     f"<img alt='{html.escape(p['title'])}' src='data:image/png;base64,{data}'>")
    for sw in record.get("sweeps", []):
        for value, run in zip(sw["values"], sw["runs"]):
            parts.append(f"<h3>{html.escape(sw['axis'])} = {html.escape(str(value))}</h3>{table(run)}")
    parts.append("</body></html>\n")
    write_atomic(path, "\n".join(parts))
