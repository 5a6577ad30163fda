"""The offline English Wikipedia sample: about 100 articles from gensim's test dump, as clean prose.

`--data wiki` everywhere (perplexity, angular distances, training text) reads it; it is built
on first use into ``datasets/wiki/wiki.jsonl`` of the cache.
"""

from __future__ import annotations

import bz2
import json
import re
from pathlib import Path

from depthcurse.assets.cache import GENSIM_PKG, build_entry, cache_dir, is_built, write_jsonl
from depthcurse.errors import DepthcurseError

WIKI_SOURCE = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
WIKI_LICENCE = "CC BY-SA 3.0 (Wikipedia text)"

_END_SECTIONS = {
    "see also", "references", "external links", "further reading", "notes", "footnotes",
    "bibliography", "sources", "citations", "works cited", "notes and references",
    "references and notes", "general references", "primary sources", "secondary sources",
}
_HEADING = re.compile(r"^\s*(=+)\s*(.*?)\s*\1\s*$")
_EMPTY_PARENS = re.compile(r"\(\s*[,;:.\-–]*\s*(?:or|and|also|;|,)?\s*[,;:.\-–]*\s*\)")
_PROSE_END = ('.', '!', '?', '"', "'", ')', '”', '’', ':', ';')


def clean_wiki_text(text: str) -> str:
    """Wikitext already passed through gensim's filter_wiki -> paragraphs of plain prose.

    Drops headings, the trailing reference/link sections, list/table/gallery residue and
    image captions (short lines not ending like a sentence); removes bold/italic quotes,
    parentheses emptied by template removal, and spaces before punctuation.
    """
    text = text.replace("\xa0", " ").replace("'''", "").replace("''", "")
    paragraphs = []
    for line in text.split("\n"):
        heading = _HEADING.match(line)
        if heading:
            if heading.group(2).strip().lower() in _END_SECTIONS:
                break
            continue
        line = line.strip()
        if not line or line[0] in "*#:;|!{}=" or line.startswith(("File:", "Image:", "Category:")) or "|" in line:
            continue
        line = _EMPTY_PARENS.sub("", line)
        line = re.sub(r"\s+([,.;:!?])", r"\1", line)
        line = re.sub(r"\(\s+", "(", line)
        line = re.sub(r"\s+\)", ")", line)
        line = re.sub(r"\s{2,}", " ", line).strip()
        if len(line.split()) < 8 or not line.endswith(_PROSE_END):
            continue
        paragraphs.append(line)
    return "\n\n".join(paragraphs)


def wiki_folder() -> Path:
    return cache_dir() / "datasets" / "wiki"


def _build_wiki(src: Path, out: Path) -> dict:
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki  # lazy: gensim is only needed to build

    dump = src / WIKI_SOURCE
    if not dump.is_file():
        raise DepthcurseError(f"{GENSIM_PKG.describe()} has no {WIKI_SOURCE}")
    articles = []
    with bz2.BZ2File(dump) as fh:
        for title, raw, _pageid in extract_pages(fh):
            if not raw.strip() or raw.lstrip().lower().startswith("#redirect"):
                continue
            text = clean_wiki_text(filter_wiki(raw))
            if len(text.split()) >= 50:
                articles.append({"title": title, "text": text})
    if not articles:
        raise DepthcurseError(f"no articles could be read from {dump}")
    write_jsonl(out / "wiki.jsonl", articles)
    words = sum(len(a["text"].split()) for a in articles)
    (out / "README.md").write_text(
        "# English Wikipedia sample\n\n"
        f"{len(articles)} articles ({words:,} words) from gensim's test dump `{WIKI_SOURCE}`, extracted with "
        "`gensim.corpora.wikicorpus.extract_pages` + `filter_wiki`; redirects, headings, lists, tables, "
        "captions and reference sections dropped. One JSON object per line: `title`, `text` "
        "(paragraphs separated by blank lines).\n\n"
        f"- Licence: {WIKI_LICENCE}, https://en.wikipedia.org/wiki/Wikipedia:Copyrights\n"
        f"- Source: {GENSIM_PKG.describe()}\n"
    )
    return {
        "name": "wiki", "kind": "text",
        "source": GENSIM_PKG.provenance(file=f"gensim/{WIKI_SOURCE}"),
        "licence": WIKI_LICENCE, "articles": len(articles), "words": words,
    }


def wiki_path(force: bool = False) -> Path:
    """Path of ``wiki.jsonl``, built on demand (DepthcurseError naming `pip install gensim`)."""
    target = wiki_folder() / "wiki.jsonl"
    if not force and is_built(target.parent):
        return target
    src = GENSIM_PKG.require("the offline Wikipedia text")
    build_entry(target.parent, lambda tmp: _build_wiki(src, tmp), force=force)
    return target


def wiki_articles() -> list[dict]:
    """[{"title", "text"}] of the offline Wikipedia sample (about 100 articles)."""
    with open(wiki_path(), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def wiki_texts() -> list[str]:
    """Article texts of the offline Wikipedia sample (paragraphs separated by blank lines)."""
    return [a["text"] for a in wiki_articles()]
