"""Generate docs/TRADEOFFS.md from a recorded run (`spekit bench ... --report DIR --sweep ...` writes DIR/run.json):
each trade-off stated as a measured fact, with its plot and the command that produced it.

    python -m spekit.bench.tradeoffs DIR [--out docs/TRADEOFFS.md] [--images docs/tradeoffs]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from ..config import UserError, write_atomic


def _overall(run: dict, name: str, key: str):
    return run["results"].get(name, {}).get("overall", {}).get(key)


def _sweep(record: dict, axis: str) -> dict | None:
    return next((s for s in record.get("sweeps", []) if s["axis"] == axis), None)


def _methods(sweep: dict) -> list[str]:
    return [n for n in dict.fromkeys(n for r in sweep["runs"] for n in r["results"]) if n != "plain"]


def _series(sweep: dict, name: str, key: str, fmt: str, unit: str = "") -> str:
    parts = []
    for value, run in zip(sweep["values"], sweep["runs"]):
        x = _overall(run, name, key)
        parts.append(f"{format(x, fmt)}{unit} at {value}" if x is not None else f"- at {value}")
    return ", ".join(parts)


def _missing(flag: str) -> str:
    return f"_Not recorded in this run: add `{flag}` to the command._\n"


def batch_section(record: dict) -> str:
    sw = _sweep(record, "batch")
    if not sw:
        return _missing("--sweep batch=1,2,4,8,16")
    lines = [f"- `{n}`: speedup over plain at the same batch size {_series(sw, n, 'speedup', '.2f', 'x')}."
             for n in _methods(sw)]
    plain = _series(sw, "plain", "tok_s", ".1f")
    return "\n".join(lines) + f"\n- plain throughput (tok/s): {plain}.\n\n![speedup vs batch](tradeoffs/sweep_batch.png)\n"


def draft_length_section(record: dict) -> str:
    out = []
    base = record["base"]
    for n, row in base["results"].items():
        acc = row["overall"]["position_acceptance"]
        if len(acc) >= 2:
            marks = sorted({1, min(5, len(acc)), len(acc)})
            out.append(f"- `{n}`: acceptance " + ", ".join(f"{acc[d - 1]:.0%} at draft position {d}" for d in marks)
                       + ".")
    if out:
        out.append("\n![acceptance by position](tradeoffs/acceptance_by_position.png)\n")
    sw = _sweep(record, "num_draft_tokens")
    if sw:
        out += [f"- `{n}`: tau {_series(sw, n, 'tau', '.2f')} (num_draft_tokens); speedup "
                f"{_series(sw, n, 'speedup', '.2f', 'x')}." for n in _methods(sw)]
        out.append("\n![tau vs draft length](tradeoffs/sweep_num_draft_tokens.png)\n")
    else:
        out.append(_missing("--sweep num_draft_tokens=2,4,8,16"))
    return "\n".join(out) + "\n"


def verify_cost_section(record: dict) -> str:
    sw = _sweep(record, "num_draft_tokens")
    if not sw:
        return _missing("--sweep num_draft_tokens=2,4,8,16")
    lines = []
    for n in _methods(sw):
        ratios = []
        for value, run in zip(sw["values"], sw["runs"]):
            v, p = _overall(run, n, "verify_ms_per_forward"), _overall(run, "plain", "verify_ms_per_forward")
            if v and p:
                ratios.append(f"{v:.1f} ms ({v / p:.2f}x plain's {p:.1f} ms) at {value}")
        if ratios:
            lines.append(f"- `{n}`: one verification forward costs " + ", ".join(ratios) + ".")
    return "\n".join(lines or ["_No verification timings recorded._"]) + "\n"


def temperature_section(record: dict) -> str:
    sw = _sweep(record, "temperature")
    if not sw:
        return _missing("--sweep temperature=0,0.7,1.0")
    lines = [f"- `{n}`: tau {_series(sw, n, 'tau', '.2f')}; speedup {_series(sw, n, 'speedup', '.2f', 'x')}."
             for n in _methods(sw)]
    return "\n".join(lines) + "\n\n![temperature effect](tradeoffs/sweep_temperature.png)\n"


def _plain_and_methods(record: dict, key: str, flag: str, per_method, image: str) -> str:
    """A sweep's section: plain's tok/s at each value, then per_method(sweep, name) for every other method."""
    sw = _sweep(record, key)
    if not sw:
        return _missing(flag)
    lines = [f"- plain throughput (tok/s): {_series(sw, 'plain', 'tok_s', '.1f')}."]
    lines += [per_method(sw, n) for n in _methods(sw)]
    return "\n".join(lines) + f"\n\n{image}\n"


def dtype_section(record: dict) -> str:
    return _plain_and_methods(
        record, "dtype", "--sweep dtype=float32,bfloat16",
        lambda sw, n: f"- `{n}`: speedup over plain in the same dtype {_series(sw, n, 'speedup', '.2f', 'x')}.",
        "![speedup by dtype](tradeoffs/sweep_dtype.png)")


def quantize_section(record: dict) -> str:
    return _plain_and_methods(
        record, "quantize", "--sweep quantize=none,int8,int4",
        lambda sw, n: f"- `{n}`: speedup over plain with the same weights {_series(sw, n, 'speedup', '.2f', 'x')}, "
                      f"tau {_series(sw, n, 'tau', '.2f')}.",
        "![speedup by weight quantization](tradeoffs/sweep_quantize.png)")


def length_section(record: dict) -> str:
    """Longer answers raise tau; the limit split (limits.py) of each length says how much of that is the loops a
    small model runs into the token limit."""
    sw = _sweep(record, "max_new_tokens")
    if not sw:
        return _missing("--sweep max_new_tokens=64,256,1024")
    lines = [f"- `{n}`: speedup {_series(sw, n, 'speedup', '.2f', 'x')}; tau {_series(sw, n, 'tau', '.2f')}."
             for n in _methods(sw)]
    for value, run in zip(sw["values"], sw["runs"]):
        split = run.get("limit_split")
        if not split:
            lines.append(f"- at {value} tokens, every turn of plain ended before the limit.")
            continue
        rep = split["repeated"]["at_limit"]
        ended = [f"`{n}` {x['ended']:.2f}x" for n, x in split["speedup"].items() if n != "plain" and x["ended"]]
        lines.append(f"- at {value} tokens, {split['at_limit']} of {split['turns']} turns of plain ran to the limit "
                     f"({split['token_share']:.0%} of its tokens; {rep or 0:.0%} of theirs continue a 4-token sequence "
                     "already in the answer)" + (": on the turns that ended, " + ", ".join(ended) if ended else "")
                     + ".")
    return "\n".join(lines) + "\n\n![speedup vs answer length](tradeoffs/sweep_max_new_tokens.png)\n"


def selection_section(record: dict) -> str:
    base = record["base"]
    spekit = [n for n, k in base["contestants"].items() if k["kind"] == "spekit"]
    lines = ["| category | best spekit method | speedup | tau |", "|---|---|---|---|"]
    for c in base["categories"]:
        best = max(spekit, key=lambda n: base["results"][n][c].get("speedup") or 0)
        cell = base["results"][best][c]
        tau = f"{cell['tau']:.2f}" if cell["tau"] is not None else "-"
        lines.append(f"| {c} | `{best}` | {cell.get('speedup', 0):.2f}x | {tau} |")
    return "\n".join(lines) + "\n\n![speedup by category](tradeoffs/speedup_by_category.png)\n"


def results_table(report: dict) -> str:
    cats = report["categories"]
    lines = ["| method | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for n, row in report["results"].items():
        cells = []
        for c in cats:
            r = row[c]
            tau = f" τ {r['tau']:.2f}" if r["tau"] is not None else ""
            cells.append(f"{r['tok_s']:.1f} ({r.get('speedup', 0):.2f}x{tau})")
        lines.append(f"| `{n}` | " + " | ".join(cells) + " |")
    skipped = "".join(f"\n- skipped `{n}`: {w}" for n, w in report.get("skipped", {}).items())
    return "\n".join(lines) + "\n" + skipped + "\n"


SECTIONS = [("Batch size erases the gain", batch_section),
            ("Acceptance falls with draft length", draft_length_section),
            ("Too wide a draft makes verification dearer than a plain step", verify_cost_section),
            ("Temperature lowers acceptance", temperature_section),
            ("Precision / quantization changes the balance", dtype_section),
            ("Weight quantization (int8 / int4) changes the balance", quantize_section),
            ("Longer answers raise tau, most where a small model loops", length_section),
            ("Which method where (measured)", selection_section)]


def render(record: dict, source: str) -> str:
    s = record["base"].get("settings", {})
    head = ["# Trade-offs, measured", "",
            f"Generated by `python -m spekit.bench.tradeoffs {source}` from the recorded run `{source}/run.json`;",
            "do not edit by hand. Recorded with:", "", f"    {record.get('command', '?')}", "",
            f"Model `{s.get('model')}`, {s.get('dtype')}, {s.get('device')}, {s.get('max_new_tokens')} new tokens, "
            f"temperature {s.get('temperature')}, batch {s.get('batch')}, {record['base']['questions']} Spec-Bench "
            "questions. Speedups are tok/s over spekit `plain` on the same prompts and settings.", ""]
    body = []
    for i, (title, fn) in enumerate(SECTIONS, 1):
        body += [f"## {i}. {title}", "", fn(record), ""]
    body += ["## All methods and peers (base run)", "", results_table(record["base"])]
    return "\n".join(head + body)


def generate(folder: str | Path, out: str | Path, images: str | Path | None = None) -> None:
    folder, out = Path(folder), Path(out)
    run = folder / "run.json"
    if not run.is_file():
        raise UserError(f"{run} not found: record a run first (spekit bench ... --report {folder} --sweep ...)")
    record = json.loads(run.read_text())
    images = Path(images) if images else out.parent / "tradeoffs"
    images.mkdir(parents=True, exist_ok=True)
    for png in folder.glob("*.png"):
        shutil.copyfile(png, images / png.name)
    text = render(record, str(folder))
    rel = images.relative_to(out.parent) if images.is_relative_to(out.parent) else images
    write_atomic(out, text.replace("](tradeoffs/", f"]({rel.as_posix()}/"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spekit.bench.tradeoffs", description=__doc__.splitlines()[0])
    p.add_argument("folder", help="the --report folder of a recorded `spekit bench` run")
    p.add_argument("--out", default="docs/TRADEOFFS.md")
    p.add_argument("--images", default=None, help="where the PNGs are copied (default: next to --out, tradeoffs/)")
    args = p.parse_args(argv)
    try:
        generate(args.folder, args.out, args.images)
    except UserError as err:
        print(f"spekit: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
