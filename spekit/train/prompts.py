"""Training prompts built from material on this machine, never from the Spec-Bench questions (the evaluation set).

Sources: the code and docstrings of the Python standard library (explain, document, rewrite, test, questions about
a function), the prose of Python's own reference (`pydoc_data.topics`: summarise, answer from a passage), and
instruction templates written here with random fillers (writing, roleplay, reasoning puzzles, maths and word
problems with random numbers, extraction from generated records, STEM and humanities questions, translation of
template sentences, short factual questions, multi-turn follow-ups). The mix follows Spec-Bench's thirteen
categories in kind, not in text. Deterministic: the same seed and count give the same file.

Two more sources, opt-in (so that the files made before stay reproducible):
- `passages`: documents of the user's (a texts file: blocks separated by blank lines, or JSONL records with a
  "text"), cut into passages to summarise and answer from (summarization, RAG), instead of Python's reference prose:
  the passages the target will be asked about in use, or the target's own earlier answers as news-like prose;
- `catalogs`: German, French and Spanish sentences from the machine's gettext catalogs (the translations of
  programs' messages under /usr/share/locale), real text to translate besides the template sentences.

A record: {"id": "p00042", "category": "coding", "turns": ["...", "..."], "source": "spekit-prompts"}.
"""
from __future__ import annotations

import ast
import functools
import json
import random
import sysconfig
from pathlib import Path

from ..config import UserError
from . import templates as T

SOURCE = "spekit-prompts"
# category -> weight; the eight MT-bench kinds and the five Spec-Bench task kinds, coding weighted up because the
# standard library gives the most varied material there
WEIGHTS = {"writing": 5, "roleplay": 4, "reasoning": 5, "math": 5, "coding": 14, "extraction": 5, "stem": 5,
           "humanities": 5, "translation": 10, "summarization": 12, "qa": 10, "math_reasoning": 10, "rag": 10}
MULTI_TURN = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


@functools.lru_cache(maxsize=4)
def stdlib_functions(limit_modules: int = 400) -> tuple[dict, ...]:
    """Functions of the standard library with a docstring: {"module", "name", "source", "doc"}, sorted (parsed
    once per process: seconds for 400 modules)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))[:limit_modules]
    out = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            src = ast.get_source_segment(text, node) or ""
            if doc and 4 <= src.count("\n") <= 30 and len(src) < 1400:
                out.append({"module": path.stem, "name": node.name, "source": src, "doc": doc})
    return tuple(out)


def prose_passages(min_words: int = 80, max_words: int = 320, documents: list[str] | None = None) -> list[str]:
    """Paragraph runs from Python's reference documentation (or from `documents`), each between min_words and
    max_words words."""
    if documents is None:
        from pydoc_data.topics import topics
        documents = [topics[key] for key in sorted(topics)]
    else:                                   # a text file's blocks are paragraphs: short ones join the next
        merged, run = [], []
        for doc in documents:
            run.append(doc)
            if sum(len(d.split()) for d in run) >= min_words:
                merged.append("\n\n".join(run))
                run = []
        documents = merged
    out = []
    for doc in documents:
        chunk: list[str] = []
        for para in doc.split("\n\n"):
            para = " ".join(para.split())
            if not para or para.startswith(("***", ">>>", "|")) or len(para.split()) < 12:
                continue
            chunk.append(para)
            words = sum(len(p.split()) for p in chunk)
            if words >= min_words:
                text = " ".join(" ".join(chunk).split()[:max_words])
                out.append(text)
                chunk = []
    return out


LOCALES = {"German": "de", "French": "fr", "Spanish": "es"}
CATALOG_DIR = Path("/usr/share/locale")


def catalog_sentences(code: str, root: Path | None = None) -> list[str]:
    """Sentences of language `code` from the gettext catalogs under root (default CATALOG_DIR;
    `<root>/<code>/LC_MESSAGES/*.mo`):
    translated messages of 6 to 60 words without format codes, options or markup, sorted, duplicates dropped."""
    import gettext

    found = set()
    for path in sorted(((root or CATALOG_DIR) / code / "LC_MESSAGES").glob("*.mo")):
        try:
            with open(path, "rb") as f:
                catalog = gettext.GNUTranslations(f)._catalog
        except (OSError, UnicodeDecodeError, ValueError, KeyError, IndexError):
            continue                                   # an unreadable catalog is material we do without
        for text in catalog.values():
            text = " ".join(text.split()) if isinstance(text, str) else ""
            if 6 <= len(text.split()) <= 60 and not text.startswith(("-", "[")) \
                    and not any(c in text for c in "%{}<>\\|_=$") and text[0].isupper():
                found.add(text)
    return sorted(found)


class Builder:
    """Draws one prompt of a given category at a time from its own random stream."""

    def __init__(self, seed: int, max_modules: int = 400, documents: list[str] | None = None,
                 catalogs: bool = False):
        self.rng = random.Random(seed)
        self.functions = stdlib_functions(max_modules)
        self.passages = prose_passages(documents=documents)
        if len(self.passages) < 2:
            raise UserError("the passages file gives fewer than two passages of 80 words or more")
        self.sentences = {lang: catalog_sentences(code) for lang, code in LOCALES.items()} if catalogs else {}

    def build(self, category: str) -> list[str]:
        turns = [getattr(self, category)()]
        if category in MULTI_TURN and self.rng.random() < 0.3:
            turns.append(self.rng.choice(T.FOLLOW_UPS))
        return turns

    # --- standard-library code and prose
    def coding(self) -> str:
        r = self.rng
        if r.random() < 0.35:
            task = r.choice(T.CODE_TASKS)
            return r.choice(T.CODE_ASKS).format(lang=r.choice(T.LANGUAGES), task=task)
        f = r.choice(self.functions)
        ask = r.choice(T.FUNCTION_ASKS).format(name=f["name"], module=f["module"])
        return f"{ask}\n\n```python\n{f['source']}\n```"

    def summarization(self) -> str:
        text = self.rng.choice(self.passages)
        return self.rng.choice(T.SUMMARY_ASKS).format(text=text)

    def rag(self) -> str:
        r = self.rng
        passages = r.sample(self.passages, 2)
        words = [w.strip(".,;:()\"'") for w in passages[0].split()]
        terms = [w for w in words if len(w) > 6 and w.isalpha()] or ["this"]
        question = r.choice(T.RAG_QUESTIONS).format(term=r.choice(terms))
        return f"{passages[0]}\n\n{passages[1]}\n\n{question}"

    # --- templates
    def writing(self) -> str:
        r = self.rng
        return r.choice(T.WRITING_ASKS).format(form=r.choice(T.FORMS), topic=r.choice(T.TOPICS),
                                               audience=r.choice(T.AUDIENCES), n=r.choice([100, 150, 200, 300]))

    def roleplay(self) -> str:
        r = self.rng
        role, questions = r.choice(T.ROLES)
        return r.choice(T.ROLE_ASKS).format(role=role, question=r.choice(questions))

    def reasoning(self) -> str:
        return T.reasoning_puzzle(self.rng)

    def math(self) -> str:
        return T.math_problem(self.rng)

    def math_reasoning(self) -> str:
        return T.word_problem(self.rng)

    def extraction(self) -> str:
        return T.extraction_task(self.rng)

    def stem(self) -> str:
        r = self.rng
        field, concepts = r.choice(T.STEM)
        return r.choice(T.EXPLAIN_ASKS).format(field=field, concept=r.choice(concepts))

    def humanities(self) -> str:
        r = self.rng
        field, concepts = r.choice(T.HUMANITIES)
        return r.choice(T.EXPLAIN_ASKS).format(field=field, concept=r.choice(concepts))

    def translation(self) -> str:
        r = self.rng
        if not self.sentences:                      # draws exactly what it drew before --catalogs existed
            return T.translation_task(r)
        lang = r.choice(T.SOURCE_LANGUAGES)
        pool = self.sentences[lang]
        if not pool or r.random() < 0.25:
            return T.translation_task(r)
        text = " ".join(r.sample(pool, r.randint(1, 2)))
        return r.choice(T.TRANSLATE_ASKS).format(lang=lang, text=text)

    def qa(self) -> str:
        return T.short_question(self.rng)


def build_prompts(count: int, seed: int = 0, max_modules: int = 400, documents: list[str] | None = None,
                  catalogs: bool = False, categories: list[str] | None = None) -> list[dict]:
    """`count` prompt records, categories drawn by WEIGHTS (only `categories` when given), duplicates skipped.
    Deterministic in its arguments on one machine (the standard library and the catalogs are part of the
    material)."""
    unknown = sorted(set(categories or []) - set(WEIGHTS))
    if unknown:
        raise UserError(f"unknown categor{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)}; "
                        f"choose from {', '.join(WEIGHTS)}")
    builder = Builder(seed, max_modules, documents, catalogs)
    cats = [c for c in WEIGHTS if not categories or c in categories]
    weights = [WEIGHTS[c] for c in cats]
    out, seen = [], set()
    tries = 0
    while len(out) < count and tries < count * 20:
        tries += 1
        category = builder.rng.choices(cats, weights)[0]
        turns = builder.build(category)
        if turns[0] in seen:
            continue
        seen.add(turns[0])
        out.append({"id": f"p{len(out):05d}", "category": category, "turns": turns, "source": SOURCE})
    return out


def write_prompts(path: str | Path, count: int, seed: int = 0, **material) -> Path:
    """Build and write the prompts as JSONL (atomically); material: build_prompts' documents, catalogs,
    categories."""
    records = build_prompts(count, seed, **material)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    tmp.replace(path)
    return path
