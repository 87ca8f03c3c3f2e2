"""The README and the documents it sends readers to: every relative link names a file that exists, and every
#anchor a heading of that file (GitHub's slugs). Three such links had gone stale when sections moved."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lstrip("#").strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        in_code ^= line.startswith("```")
        if not in_code and re.match(r"#+ ", line):
            slug = _slug(line)
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "data").rglob("*.md"))]


def test_relative_links_and_anchors_resolve():
    broken = []
    for doc in _documents():
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):                       # http(s), mailto: not ours to check
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_slugs_follow_githubs_rule():
    assert _slug("### τ on full trees: `--cost-profile flat` (2026-12-05, latest)") == \
        "τ-on-full-trees---cost-profile-flat-2026-12-05-latest"
    assert _slug("## Set-up (Python 3.11, a fresh machine)") == "set-up-python-311-a-fresh-machine"
