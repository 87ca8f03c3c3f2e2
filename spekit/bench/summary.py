"""Figures from answer records, per contestant, per category and overall: tok/s, speedup over spekit plain (with
its interval over resampled questions, intervals.py) and over HF plain, tau, acceptance per draft position, greedy
identity with plain, draft / verify time split. Only questions every contestant has answered count, so that all
ratios compare the same prompts."""
from __future__ import annotations

from .intervals import LEVEL, speedup_interval
from .limits import describe, limit_split
from .variants import method_of


def summarize(records: dict[str, list[dict]], contestants, skipped: dict[str, str], limit: int | None = None,
              intervals: bool = True) -> dict:
    """limit: the run's --max-new-tokens; the figures are then also split between the turns plain ran to it and
    the others (limits.py), when any did. intervals: the speedups' intervals over resampled questions (a run of
    one question at a time: in a batch the rows share the batch's time, so its questions are no separate
    measures)."""
    names = [c.name for c in contestants]
    common = set.intersection(*[{r["question_id"] for r in records[n]} for n in names]) if names else set()
    by_name = {n: [r for r in records[n] if r["question_id"] in common] for n in names}
    plain = {r["question_id"]: r["spekit"]["token_ids"] for r in by_name.get("plain", [])}
    cats = list(dict.fromkeys(r["spekit"]["group"] for r in by_name[names[0]])) if names else []
    cats.append("overall")
    results = {n: {c: _cell(_in(by_name[n], c), plain) for c in cats} for n in names}
    for n in names:                       # a peer against its own engine's plain (hf-lookup against hf-plain)
        own = own_plain(n)
        if own != "plain" and own in by_name and own != n:
            ref = {r["question_id"]: r["spekit"]["token_ids"] for r in by_name[own]}
            for c in cats:
                results[n][c]["identical_to_own_plain"] = _cell(_in(by_name[n], c), ref)["identical"]
    for n in names:
        for c in cats:
            cell = results[n][c]
            for key, ref in (("speedup", "plain"), ("speedup_vs_hf_plain", "hf-plain"),
                             ("speedup_vs_llamacpp_plain", "llamacpp-plain")):
                base = results.get(ref, {}).get(c, {}).get("tok_s")
                if base:
                    cell[key] = round(cell["tok_s"] / base, 3)
            if intervals and n != "plain" and "plain" in by_name:
                cell["speedup_interval"] = speedup_interval(_in(by_name[n], c), _in(by_name["plain"], c))
    for n in names:                       # a method variant against its method at the run's options
        base = method_of(n)
        if base != n and base in by_name:
            for c in cats:
                ref = results[base][c]["tok_s"]
                results[n][c]["vs_method"] = round(results[n][c]["tok_s"] / ref, 3) if ref else None
                results[n][c]["vs_method_interval"] = speedup_interval(_in(by_name[n], c), _in(by_name[base], c)) \
                    if intervals else None
    for c in contestants:                 # each spekit method against the peer doing the same thing
        if c.counterpart in results:
            for cat in cats:
                peer = results[c.counterpart][cat]["tok_s"]
                results[c.name][cat]["speedup_vs_counterpart"] = round(results[c.name][cat]["tok_s"] / peer, 3) \
                    if peer else None
    kinds = {c.name: {"kind": c.kind, "lossless": c.lossless, "counterpart": c.counterpart} for c in contestants}
    report = {"bench": "spec-bench", "categories": cats, "results": results, "contestants": kinds,
              "skipped": skipped, "questions": len(common)}
    split = limit_split(by_name, limit) if limit else None
    if split:
        report["limit_split"] = split
    return report


def own_plain(name: str) -> str:
    """A peer's plain decoding on its own engine ("hf-lookup" -> "hf-plain"); a spekit method's is "plain"."""
    engine, sep, _ = name.partition("-")
    return f"{engine}-plain" if sep and engine in ("hf", "llamacpp") else "plain"


def _in(recs: list[dict], category: str) -> list[dict]:
    return [r for r in recs if category in ("overall", r["spekit"]["group"])]


def _cell(recs: list[dict], plain: dict) -> dict:
    tokens = sum(sum(r["choices"][0]["new_tokens"]) for r in recs)
    charged = sum(sum(r["spekit"]["charged_s"]) for r in recs)
    fwd = [f for r in recs for f in r["spekit"]["forwards"]]
    draft = [x for r in recs for x in r["spekit"]["draft_s"]]
    verify = [x for r in recs for x in r["spekit"]["verify_s"]]
    recording = [x for r in recs for x in r["spekit"].get("recording_s", [])]      # (older answer folders lack it)
    width = max((len(r["spekit"]["offered"]) for r in recs), default=0)
    offered = [sum(r["spekit"]["offered"][d] for r in recs if d < len(r["spekit"]["offered"])) for d in range(width)]
    accepted = [sum(r["spekit"]["accepted"][d] for r in recs if d < len(r["spekit"]["accepted"]))
                for d in range(width)]
    known = fwd and all(f is not None for f in fwd)
    timed = draft and all(x is not None for x in draft + verify)
    same = [r["spekit"]["token_ids"] == plain.get(r["question_id"]) for r in recs]
    return {
        "tok_s": round(tokens / charged, 2) if charged else 0.0,
        "tau": round(tokens / sum(fwd), 3) if known and sum(fwd) else None,
        "position_acceptance": [round(a / o, 4) if o else 0.0 for a, o in zip(accepted, offered)],
        "identical": round(sum(same) / len(same), 3) if same and plain else None,
        "draft_share": round(sum(draft) / charged, 3) if timed and charged else None,
        "verify_share": round(sum(verify) / charged, 3) if timed and charged else None,
        "recording_share": round(sum(recording) / charged, 3) if recording and None not in recording and charged
        else None,
        "verify_ms_per_forward": round(1000 * sum(verify) / sum(fwd), 3) if timed and known and sum(fwd) else None,
        "prompts": len(recs), "new_tokens": tokens, "seconds": round(charged, 3)}


def print_table(report: dict, out) -> None:
    """A table a person can read: tok/s (speedup over spekit plain | over HF plain | tau | identical)."""
    cats, res = report["categories"], report["results"]
    s = report.get("settings", {})
    quant = f"  quantize {s['quantize']}" if s.get("quantize", "none") != "none" else ""
    compiled = "  compiled" if s.get("compile") else ""
    backend = report.get("backend", {}).get("name", "torch")
    llama = backend == "llama.cpp"
    prompts = f", {s.get('prefill', 'exact')} prompts" if s.get("kernels") == "exact" else ""
    kind = f"backend llama.cpp ({s.get('kernels')} kernels{prompts})" if llama else f"dtype {s.get('dtype')}"
    print(f"model {s.get('model')}  {kind}{quant}{compiled}  max_new_tokens {s.get('max_new_tokens')}  "
          f"temperature {s.get('temperature')}  batch {s.get('batch')}  ({report['questions']} questions)", file=out)
    peer = "llama.cpp plain" if llama else "HF plain"
    print(f"tok/s (speedup over spekit plain | over {peer} | tau | share identical to plain)", file=out)
    print(f"{'method':<16}" + "".join(f"{c:>31}" for c in cats), file=out)
    kinds = report.get("contestants", {})
    key = "speedup_vs_llamacpp_plain" if llama else "speedup_vs_hf_plain"
    for m, row in res.items():
        cells = [_fmt(row[c], key) for c in cats]
        label = m + ("*" if not kinds.get(m, {}).get("lossless", True) else "")
        print(f"{label:<16}" + "".join(f"{x:>31}" for x in cells), file=out)
    if any(not k["lossless"] for k in kinds.values()):
        print("  * lossy: an opt-in method whose output may differ from plain's", file=out)
    for m, k in kinds.items():
        vs = res[m]["overall"].get("speedup_vs_counterpart")
        if vs is not None:
            print(f"  {m} vs its counterpart {k['counterpart']}: {vs:.2f}x", file=out)
    own = [f"{m} {row['overall']['identical_to_own_plain']:.0%}" for m, row in res.items()
           if row["overall"].get("identical_to_own_plain") is not None]
    if own and not s.get("temperature"):
        print("  peers' answers identical to their own engine's plain answers (greedy: a lossless method's are all): "
              + ", ".join(own), file=out)
    spread = [f"{m} {_range(row['overall'])}" for m, row in res.items() if row["overall"].get("speedup_interval")]
    if spread:
        print(f"  speedup over plain, {LEVEL:.0%} of the questions resampled within (paired bootstrap; the JSON has "
              f"it per category): " + ", ".join(spread), file=out)
    for m, row in res.items():
        o = row["overall"]
        if o.get("vs_method") is not None:
            spread = o.get("vs_method_interval")
            print(f"  {m} against {method_of(m)}: {o['vs_method']:.3f}x"
                  + (f" ({spread[0]:.3f}-{spread[1]:.3f}x over resampled questions)" if spread else ""), file=out)
    for m, row in res.items():
        o = row["overall"]
        if o["position_acceptance"] or o["draft_share"] is not None:
            acc = " ".join(f"{a:.2f}" for a in o["position_acceptance"][:8]) or "-"
            split = (f"draft {o['draft_share']:.0%} verify {o['verify_share']:.0%} of the time"
                     if o["draft_share"] is not None else "")
            if o.get("recording_share"):                      # CUDA graphs recorded inside the timed answers
                split += f" (recording CUDA graphs {o['recording_share']:.0%})"
            print(f"  {m:<14} acceptance by draft position: {acc}   {split}", file=out)
    if report.get("limit_split"):
        print(describe(report["limit_split"]), file=out)
    for name, why in report.get("skipped", {}).items():
        print(f"  skipped {name}: {why}", file=out)
    for d in report.get("divergences", []):
        gap = "not among plain's 20 likeliest" if d["gap_nats"] is None else f"{d['gap_nats']:.4f} nats"
        again = "" if d.get("plain_repeats", True) else " (plain run again wrote another text before it)"
        print(f"  {d['method']} left plain at token {d['token']} of question {d['question_id']} turn {d['turn']}: "
              f"plain's logit gap there {gap}{again}", file=out)


def _range(r: dict) -> str:
    low, high = r["speedup_interval"]
    return f"{low:.2f}-{high:.2f}x"


def _fmt(r: dict, key: str = "speedup_vs_hf_plain") -> str:
    tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
    hf = f"{r[key]:.2f}x" if r.get(key) is not None else "-"
    sp = f"{r['speedup']:.2f}x" if r.get("speedup") is not None else "-"
    same = f"{r['identical']:.0%}" if r["identical"] is not None else "-"
    return f"{r['tok_s']:6.1f} ({sp}|{hf}|{tau}|{same})"
