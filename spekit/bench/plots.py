"""PNG plots of a recorded run (matplotlib, the optional `plot` extra): speedup by category and acceptance by
draft position for the base run; for each sweep, speedup and tau against the swept value (batch size, draft
length, temperature, dtype ...)."""
from __future__ import annotations

from pathlib import Path

from ..config import UserError

TITLES = {"batch": "Speedup vs batch size", "num_draft_tokens": "tau and speedup vs draft length",
          "temperature": "Temperature effect", "dtype": "Speedup by dtype",
          "quantize": "Speedup by weight quantization", "max_new_tokens": "Speedup and tau vs answer length"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UserError("plots need matplotlib: pip install 'spekit[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def make_plots(record: dict, folder: Path) -> list[dict]:
    """Write the PNGs into `folder`; returns [{file, title, caption}] in report order."""
    plt = _pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    made = [_by_category(plt, record["base"], folder), _by_position(plt, record["base"], folder)]
    made += [_sweep(plt, sw, folder) for sw in record.get("sweeps", [])]
    return [m for m in made if m]


def _save(plt, fig, folder: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(folder / name, dpi=110)
    plt.close(fig)
    return name


def _by_category(plt, report: dict, folder: Path) -> dict:
    cats, res = report["categories"], report["results"]
    names = [n for n in res if n != "plain"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cats)), 4))
    width = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        ax.bar([c + i * width for c in range(len(cats))], [res[n][c].get("speedup", 0) for c in cats], width,
               label=n)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cats))], cats, rotation=20)
    ax.set_ylabel("speedup over spekit plain")
    ax.legend(fontsize=7, ncol=2)
    return {"file": _save(plt, fig, folder, "speedup_by_category.png"), "title": "Speedup by category",
            "caption": "tok/s of each method over spekit plain on the same questions (1.0 = plain)"}


def _by_position(plt, report: dict, folder: Path) -> dict | None:
    curves = {n: row["overall"]["position_acceptance"] for n, row in report["results"].items()
              if row["overall"]["position_acceptance"]}
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for n, acc in curves.items():
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=n)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (given offered)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    return {"file": _save(plt, fig, folder, "acceptance_by_position.png"), "title": "Acceptance by draft position",
            "caption": "share of draft tokens accepted at each depth, among those offered at that depth"}


def _sweep(plt, sweep: dict, folder: Path) -> dict:
    key, values, runs = sweep["axis"], sweep["values"], sweep["runs"]
    names = list(dict.fromkeys(n for r in runs for n in r["results"]))
    xs = list(range(len(values))) if any(isinstance(v, str) for v in values) else values
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for n in names:
        sp = [r["results"].get(n, {}).get("overall", {}).get("speedup") for r in runs]
        tau = [r["results"].get(n, {}).get("overall", {}).get("tau") for r in runs]
        left.plot(xs, [float("nan") if v is None else v for v in sp], marker="o", label=n)
        right.plot(xs, [float("nan") if v is None else v for v in tau], marker="o", label=n)
    left.axhline(1.0, color="black", lw=0.8)
    for ax, label in ((left, "speedup over spekit plain"), (right, "tau (tokens per target forward)")):
        ax.set_xlabel(key)
        ax.set_ylabel(label)
        if key == "batch":
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(v) for v in values])
        ax.legend(fontsize=7)
    return {"file": _save(plt, fig, folder, f"sweep_{key}.png"), "title": TITLES.get(key, f"Sweep over {key}"),
            "caption": f"overall speedup and tau of each method at each {key}; spekit plain at the same {key} = 1"}
