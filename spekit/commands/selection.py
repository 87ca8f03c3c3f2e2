"""The selection table of `spekit advise --explain`: which method fits which situation, and why, with the figures a
recorded benchmark gives each method. The rules are written here; every figure is read from a benchmark record
(`spekit bench ... --out FILE`, which stores the command that made it), so the table says what the latest recorded
run measured and how to measure it again.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..config import UserError
from ..proposers import REGISTRY

DOCS = Path(__file__).resolve().parents[2] / "docs" / "bench"
# the records the table quotes: the latest all-method run on the torch backend, and on llama.cpp; a draft model of
# another family (SmolLM2-135M drafting for Gemma-3-270M)
RECORDS = {"torch": DOCS / "avx512bf16_bf16_all_3q_256_s50.json",
           "llama.cpp": DOCS / "llamacpp_smollm2_exact_3q_256.json",
           "another family": DOCS / "cross_gemma_smollm2_torch_3q_128.json"}

# (situation, method(s), why, which record's figures apply)
SELECTION = [
    ("a datastore of the model's own answers ships for it (or can be built: `spekit train rest`)", "rest",
     "retrieval drafts a tree from the context and from the model's stock phrasing in its earlier answers: no "
     "weights, nothing on the device", "torch"),
    ("a server or batch job whose requests repeat templates (agents, extraction, the same tasks over new inputs)",
     "rest", "besides its datastore, rest drafts from the texts the engine finished before (--history-tokens)",
     "torch"),
    ("output copies the input (summaries, RAG answers, code edits, extraction)", "ngram",
     "prompt lookup costs nothing to draft and no memory; long verbatim spans give a high tau", "torch"),
    ("a GGUF file on a CPU, llama.cpp installed (--backend llama.cpp)", "ngram",
     "there a wide forward costs nearly its width, so the drafter whose drafts are copies pays best", "llama.cpp"),
    ("a smaller model with the same tokenizer is at hand", "draft",
     "a general-purpose drafter; pays when the draft is ~10x+ cheaper than the target and agrees often", "torch"),
    ("only a smaller model of another family (another tokenizer) is at hand", "draft",
     "the draft reads and writes text through both tokenizers, still exact; it pays only where a drafted token costs "
     "a small fraction of a target forward and is accepted often (two small models of 135M and 270M: it does not, "
     "and the pacer keeps to plain steps); `spekit advise --draft M` measures both on your prompts",
     "another family"),
    ("trained heads ship for the model (spekit/data/heads/<model>/)", "eagle3 / eagle / medusa",
     "heads read the target's hidden states: acceptance on open-ended text for little memory", "torch"),
    ("trained EAGLE-3 heads, and answers that partly copy the prompt or themselves", "eagle3-lookup",
     "one tree holds the head's guesses and retrieval's continuations, verified in one forward", "torch"),
    ("the model has built-in multi-token-prediction layers", "mtp",
     "the model's own MTP layers draft for free; nothing to train or load", "torch"),
    ("no datastore, no heads, no draft model, and a target whose wide forwards cost about one token (a GPU)",
     "recycle", "token recycling drafts a tree from the target's own top-k next tokens of its earlier forwards: no "
     "weights, k token ids per token seen (rest has it as a fourth source: --recycle 8)", "torch"),
    ("open-ended chat, no draft model, no heads, little repetition", "lookahead / jacobi",
     "draftless: the model drafts for itself from n-gram pools or fixed-point iterations", "torch"),
    ("memory is tight, no room for a draft model", "early-exit",
     "self-speculation reuses the target's own first layers: no extra weights", "torch"),
    ("large batches (GPU >= 16, CPU >= 2-4 rows)", "plain",
     "verification cost grows with the batch; the gain shrinks and can turn into a loss (the governor then holds "
     "drafts back)", None),
    ("sampling at high temperature", "any, shorter drafts",
     "acceptance falls as the distribution flattens; all lossless methods keep the distribution exact", None),
]


def read_record(path: str | Path) -> dict:
    """A `spekit bench --out` record (UserError for a file that is not one)."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise UserError(f"cannot read the benchmark record {path} ({err.strerror or err})") from None
    except ValueError:
        raise UserError(f"{path} is not a benchmark record (JSON from `spekit bench --out`)") from None
    if not isinstance(record, dict) or not isinstance(record.get("results"), dict):
        raise UserError(f"{path} is not a benchmark record: it has no per-method results")
    return record


def figure(record: dict, method: str) -> str | None:
    """`method`'s overall figure in a record: speedup over plain and tau; None where the run did not have it."""
    overall = record["results"].get(method, {}).get("overall")
    if not overall or "speedup" not in overall:
        return None
    return f"{method} {overall['speedup']:.2f}x plain (tau {overall['tau']:.2f})"


def backend_of(record: dict) -> str:
    """The backend a record's run used ("torch" for records that do not say)."""
    backend = record.get("backend") or record.get("settings", {}).get("backend") or "torch"
    return backend.get("name", "torch") if isinstance(backend, dict) else str(backend)


def describe(record: dict, path: Path) -> str:
    """What run a record holds, and the command that made it."""
    s = record.get("settings", {})
    questions = max((r.get("overall", {}).get("prompts", 0) for r in record["results"].values()), default=0)
    backend = backend_of(record)
    kind = f"llama.cpp {record['backend'].get('settings', {}).get('kernels', '')} kernels" if backend == "llama.cpp" \
        else f"torch, {s.get('dtype')}"
    what = f"{questions} questions x {s.get('max_new_tokens')} tokens, {s.get('model')}, {kind}"
    command = record.get("command", "its command: see docs/RESULTS.md")
    return f"{path.name}: {what}\n    made by: {command}"


def methods_of(cell: str) -> list[str]:
    return [m for m in cell.replace(",", " ").replace("/", " ").split() if m in REGISTRY]


def explain(out=None, records: dict | None = None) -> None:
    """Print the table; records: backend -> record path (default RECORDS). A record that is not on disk (an
    installed package without the docs folder) leaves its figures out and says so."""
    out = out or sys.stdout
    paths = {k: Path(v) for k, v in (records or RECORDS).items()}
    loaded = {k: read_record(p) for k, p in paths.items() if p.is_file()}
    print("situation -> method: why; measured (used when nothing can be measured here; `spekit advise --model M "
          "--prompts FILE` measures on your prompts)", file=out)
    for situation, cell, why, source in SELECTION:
        here = methods_of(cell)
        mark = "" if here or cell.startswith(("plain", "any")) else "  [not installed here]"
        print(f"- {situation}\n    -> {cell}: {why}{mark}", file=out)
        figures = [f for f in (figure(loaded[source], m) for m in here) if f] if source in loaded else []
        if figures:
            print(f"       measured ({source}): {', '.join(figures)}", file=out)
    print("figures from:", file=out)
    for backend, path in paths.items():
        line = describe(loaded[backend], path) if backend in loaded else f"{path} (not here: figures left out)"
        print(f"  [{backend}] {line}", file=out)
