"""The opt-in material of `spekit train prompts`: the user's documents as passages, sentences of the machine's
gettext catalogs to translate, a subset of the categories; and scripts/answer_texts.py, which turns the target's
earlier answers into such documents. Bad input gets a clear error."""
from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path

import pytest

from spekit.commands import main
from spekit.config import UserError
from spekit.train import prompts as P
from spekit.train.prompts import build_prompts, catalog_sentences

ROOT = Path(__file__).resolve().parent.parent
DOC = ("The harbour town of Keldmoor rebuilt its old lighthouse this spring after a storm had torn away the lamp "
       "room. Volunteers carried the stones up the cliff path by hand, and the mayor, Ada Brenn, said the light "
       "would shine again before the autumn fishing season began.\n\nThe new lamp uses a fraction of the power of "
       "the old one. Engineers from the coastal office tested it for three nights and reported that ships could "
       "see it from twenty kilometres away, farther than ever before, even in light rain and fog at sea.")


def write_mo(path: Path, messages: dict[str, str]) -> None:
    """A gettext catalog (GNU .mo, little-endian, no hash table) holding messages id -> translation."""
    ids = sorted(messages)
    keys = [i.encode() for i in ids]
    vals = [messages[i].encode() for i in ids]
    n = len(ids)
    start = 7 * 4 + 16 * n
    blob, key_table, val_table = b"", [], []
    for k in keys:
        key_table.append((len(k), start + len(blob)))
        blob += k + b"\0"
    for v in vals:
        val_table.append((len(v), start + len(blob)))
        blob += v + b"\0"
    head = struct.pack("<7I", 0x950412DE, 0, n, 28, 28 + 8 * n, 0, 0)
    tables = b"".join(struct.pack("<2I", *e) for e in key_table + val_table)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(head + tables + blob)


def test_catalog_sentences_are_whole_translated_messages(tmp_path):
    write_mo(tmp_path / "de" / "LC_MESSAGES" / "app.mo", {
        "": "Content-Type: text/plain; charset=UTF-8\n",
        "The file could not be opened because it is locked": "Die Datei konnte nicht geöffnet werden, weil sie gesperrt ist",
        "Copy %s to %s": "Kopiere %s nach %s ohne weitere Rückfrage an den Benutzer",      # a format code
        "-v, --verbose  print more": "-v, --verbose  mehr Ausgaben anzeigen als sonst üblich",   # an option
        "Quit": "Beenden"})                                                                    # too short
    (tmp_path / "de" / "LC_MESSAGES" / "broken.mo").write_bytes(b"not a catalog")            # skipped
    assert catalog_sentences("de", tmp_path) == ["Die Datei konnte nicht geöffnet werden, weil sie gesperrt ist"]
    assert catalog_sentences("fr", tmp_path) == []


def test_catalogs_give_translation_prompts(tmp_path, monkeypatch):
    write_mo(tmp_path / "de" / "LC_MESSAGES" / "app.mo", {
        f"Message {i}": f"Die Nachricht Nummer {i} wurde erfolgreich an den Server gesendet" for i in range(40)})
    monkeypatch.setattr(P, "CATALOG_DIR", tmp_path)
    recs = build_prompts(40, seed=1, max_modules=5, catalogs=True, categories=["translation"])
    assert {r["category"] for r in recs} == {"translation"}
    assert any("wurde erfolgreich an den Server gesendet" in r["turns"][0] for r in recs)
    assert recs == build_prompts(40, seed=1, max_modules=5, catalogs=True, categories=["translation"])


def test_documents_are_the_passages_of_summaries_and_answers():
    recs = build_prompts(30, seed=2, max_modules=5, documents=[DOC, DOC.replace("Keldmoor", "Arnwick")],
                         categories=["summarization", "rag"])
    assert {r["category"] for r in recs} == {"summarization", "rag"}
    assert all("lighthouse" in r["turns"][0] for r in recs)


def test_without_the_new_material_a_seed_gives_the_prompts_it_gave_before():
    """The training data sets' commands stay exact: `spekit train prompts --count 400 --seed 12` wrote the prompts
    of data set s9 (docs/TRAINING.md) before these options existed; its first 60 records are kept as a fixture."""
    shipped = [json.loads(line) for line in (ROOT / "tests/data/prompts_seed12_first60.jsonl").open()]
    assert build_prompts(60, seed=12) == shipped


def test_bad_material_is_refused(tmp_path, capsys):
    with pytest.raises(UserError, match="unknown category poetry"):
        build_prompts(5, categories=["poetry"], max_modules=5)
    with pytest.raises(UserError, match="fewer than two passages"):
        build_prompts(5, documents=["far too short"], max_modules=5)
    out = str(tmp_path / "p.jsonl")
    assert main(["train", "prompts", "--out", out, "--self-instruct", "--catalogs"]) == 2
    assert "one or the other" in capsys.readouterr().err
    assert main(["train", "prompts", "--out", out, "--passages", str(tmp_path / "missing.txt")]) == 2
    assert "not found" in capsys.readouterr().err
    assert not Path(out).exists()
    docs = tmp_path / "docs.txt"
    docs.write_text(DOC + "\n\n" + DOC.replace("Keldmoor", "Arnwick"))
    assert main(["train", "prompts", "--out", out, "--count", "6", "--passages", str(docs),
                 "--categories", "summarization"]) == 0
    assert len(Path(out).read_text().splitlines()) == 6
    assert "wrote 6 prompts" in capsys.readouterr().err
    assert main(["train", "prompts", "--out", out, "--count", "500", "--categories", "qa"]) == 0
    err = capsys.readouterr().err                       # the short-question templates give fewer distinct ones
    written = len(Path(out).read_text().splitlines())
    assert written < 500 and f"wrote {written} prompts" in err and "distinct" in err


def test_answer_texts_keeps_long_answers_that_do_not_loop(tmp_path):
    spec = importlib.util.spec_from_file_location("answer_texts", ROOT / "scripts" / "answer_texts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    words = {i: w for i, w in enumerate(DOC.split())}

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(words[i] for i in ids)

    loop = [0, 1, 2, 3, 4] * 20
    recs = [{"id": "a", "prompt_ids": [1], "answer_ids": list(range(len(words))), "finish": "stop"},
            {"id": "b", "prompt_ids": [1], "answer_ids": loop, "finish": "length"},
            {"id": "c", "prompt_ids": [1], "answer_ids": [0, 1, 2], "finish": "stop"}]
    (tmp_path / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert mod.distinct_share("a b c d a b c d".split()) == 0.8
    assert mod.answer_texts([str(tmp_path)], Tok(), min_words=20, min_distinct=0.9) == [" ".join(DOC.split())]


def test_interleave_prompts_takes_files_in_turn_and_leaves_out_seen_requests(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("interleave_prompts", ROOT / "scripts" / "interleave_prompts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def write(name, firsts):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"id": f"{name[0]}{i}", "turns": [t]}) + "\n"
                                for i, t in enumerate(firsts)))
        return str(path)

    a = write("a.jsonl", ["a0", "a1", "a2", "a3", "a4"])
    b = write("b.jsonl", ["b0", "old", "b2"])
    seen = write("seen.jsonl", ["old", "a3 "])
    out = tmp_path / "out.jsonl"
    monkeypatch.setattr(sys, "argv", ["x", f"{a}=s-:2", f"{b}=t-", "--seen", seen, "--out", str(out)])
    mod.main()
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in got] == ["s-a0", "s-a1", "t-b0", "s-a2", "s-a4", "t-b2"]
    monkeypatch.setattr(sys, "argv", ["x", f"{a}=s-:0", "--out", str(out)])
    with pytest.raises(SystemExit, match="at least 1"):
        mod.main()
    (tmp_path / "bad.jsonl").write_text('{"id": 1}\n')
    monkeypatch.setattr(sys, "argv", ["x", str(tmp_path / "bad.jsonl"), "--out", str(out)])
    with pytest.raises(SystemExit, match="bad.jsonl:1"):
        mod.main()
    assert [r["id"] for r in map(json.loads, out.read_text().splitlines())][0] == "s-a0"   # left as it was
