"""Findings whose words follow from their numbers (issue 79, item 6; issue 88, item 4).

- Every interval the README or a doc quotes, in any form the tool prints (`VALUE [LOW, HIGH]`,
  `VALUE (LOW-HIGH)` or `(LOW to HIGH)`, a "%" or "x" on the figures, a Unicode minus), holds its
  value, and the comparison word beside it (after it, or before it: the tool prints both) is the
  word the tool gives that interval (`stats.verdicts`): a word that tells two things apart (more,
  less, better, worse, beats, pays, ahead, higher, lower, agrees, ...) needs an interval off the
  null (0 for a difference, 1 for an "x" ratio), a word of a tie (cannot tell, ties, cannot be told
  apart) one that holds it, and a directed word its side; an agreement in a table has the direction
  its column expects (`EXPECTED_SIGN`).
- Each published comparison whose figures are stored (`docs/findings/*.json`: the figures of every
  run it rests on) is recomputed by the code that printed it, and the doc must hold the tool's own
  lines and cells, and its headline's claims must be what the stored figures give: a doc edited by
  hand, or figures that moved, fail here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from depthcurse.stats.verdicts import agreement_word, difference_word

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
READ = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
NUMBER = r"[-+]?\d+(?:\.\d+)?"
LEAD = r"(?<![\w.±])(?<!± )"  # a figure of its own: not fp32's 32, not a standard deviation's ± 0.045
FIGURE = r"(?:x|%)?"
UNIT = r"(?:\**\s*(?:nats?|layers?|pp|points?|tokens?/s)?\s*\**:?\s*)"
FORMS = [re.compile(rf"{LEAD}(?P<value>{NUMBER})(?P<unit>x|%)?{UNIT}\[(?P<low>{NUMBER}){FIGURE},\s*(?P<high>{NUMBER}){FIGURE}\]"),
         # a parenthesised range after a figure with decimals or a unit (a layer count's "4 (25-28)" is a list of layers)
         re.compile(rf"{LEAD}(?P<value>{NUMBER}\.\d+|{NUMBER}(?=[x%]))(?P<unit>x|%)?\**\s?\((?:95% interval:?\s*)?(?P<low>{NUMBER}){FIGURE}"
                    rf"(?:-|\s+to\s+)(?P<high>{NUMBER}){FIGURE}\)")]
UP = {"more", "higher", "ahead", "later", "further", "faster", "beats", "above"}
DOWN = {"less", "lower", "earlier", "closer", "slower", "below"}
TELLS = UP | DOWN | {"apart", "told apart", "agrees", "opposite", "better", "worse", "pays", "does not pay", "beat"}
TIES = {"cannot tell", "ties", "tie", "tied", "cannot be told", "cannot be told apart", "not told apart", "no difference"}
WORDS = "|".join(sorted(TELLS | TIES, key=len, reverse=True))
ANY_WORD = re.compile(rf"\b({WORDS})\b")
RIGHT_AFTER = re.compile(rf"^\)?\s*:?\s*\**\s*({WORDS})\b")
RIGHT_BEFORE = re.compile(rf"\b({WORDS})\**\s*:?\s*\(?\s*\**$")
CLAUSE = r",|;|\||\n\n|\. "
EXPECTED_SIGN = {"removed alone": +1, "pick": -1}  # depth-use's agreement columns: a costly layer is never in a cheap pick


def _half(figure: str) -> float:
    """Half the last printed digit: what rounding can move a printed figure."""
    return 0.5 * 10 ** -len(figure.split(".")[1]) if "." in figure else 0.5


def _word(text: str, start: int, end: int) -> str | None:
    """The comparison word of the interval at text[start:end]: right after it, right before it, else
    the first in its clause after it, else the last in its clause before it."""
    for found in (RIGHT_AFTER.search(text[end : end + 40]), RIGHT_BEFORE.search(text[max(0, start - 40) : start])):
        if found:
            return found.group(1)
    after = ANY_WORD.search(re.split(CLAUSE, text[end : end + 80])[0])
    if after:
        return after.group(1)
    before = list(ANY_WORD.finditer(re.split(CLAUSE, text[max(0, start - 80) : start])[-1]))
    return before[-1].group(1) if before else None


def _column(text: str, start: int) -> str | None:
    """The header of the table column a position lies in (None outside a table)."""
    line_start = text.rfind("\n", 0, start) + 1
    line = text[line_start : text.find("\n", start)]
    if not line.startswith("|"):
        return None
    rows = text[:line_start].rstrip("\n").split("\n")
    header = next((rows[i - 1] for i in range(len(rows) - 1, 0, -1) if rows[i].startswith("|---")), None)
    index = text[line_start:start].count("|") - 1
    cells = header.strip("|").split("|") if header else []
    return cells[index].strip() if 0 <= index < len(cells) else None


def quoted(text: str) -> list[dict]:
    """Every interval quoted in `text`: the quote, its value, bounds, null, word and column."""
    text = text.replace("\u2212", "-")
    flat = re.sub(r"(?<!\n)\n(?![\n|])", " ", text)  # a sentence over lines is one (tables and paragraphs stay apart)
    out = []
    for form in FORMS:
        for m in form.finditer(flat):
            low, high = float(m["low"]), float(m["high"])
            if low > high or (m["unit"] != "%" and "%" in m.group(0).rsplit("[", 1)[-1].rsplit("(", 1)[-1]):
                continue  # a list or a count's share ("8 of 8 (68%-100%)"), not this figure's interval
            out.append({"quote": m.group(0), "value": m["value"], "low": m["low"], "high": m["high"], "null": 1.0 if m["unit"] == "x" else 0.0,
                        "word": _word(flat, m.start(), m.end()), "column": _column(flat, m.start()), "line": text.count("\n", 0, m.start()) + 1})
    return out


def problems_of(q: dict) -> list[str]:
    """What a quoted interval says that its figures do not give."""
    value, low, high, null, word = float(q["value"]), float(q["low"]), float(q["high"]), q["null"], q["word"]
    wrong = []
    if not low - _half(q["low"]) - _half(q["value"]) <= value <= high + _half(q["high"]) + _half(q["value"]):
        wrong.append("its value lies outside its interval")
    said = difference_word([low - null, high - null])
    if word in TIES and said != "cannot tell":
        wrong.append(f'"{word}", but the interval is off {null:g}: the tool says {said}')
    if word in TELLS and said == "cannot tell":
        wrong.append(f'"{word}", but the interval holds {null:g}: the tool says cannot tell')
    if (word in UP and said == "less") or (word in DOWN and said == "more"):
        wrong.append(f'"{word}", but the interval is on the other side of {null:g}')
    if word in ("agrees", "opposite") and q["column"]:
        sign = next((s for phrase, s in EXPECTED_SIGN.items() if phrase in q["column"]), None)
        if sign is None:
            wrong.append(f"an agreement in the column {q['column']!r}, whose expected direction EXPECTED_SIGN does not name")
        elif agreement_word([low, high], sign) != word:
            wrong.append(f'"{word}", but against the column\'s expected sign {sign:+d} the tool says {agreement_word([low, high], sign)}')
    return wrong


def test_the_lint_reads_every_form_the_tool_prints_and_tells_each_wrong_word_by_hand():
    """Worked by hand: the word after and before, a parenthesised range, a range in words, an x ratio
    against 1, a Unicode minus, a "%" interval, a value outside its interval, a tie word off 0, a
    directed word on the wrong side, a list of layers and a count's share left alone."""
    text = ("influence +0.050 [+0.020, +0.079] more; settling +3.3 [+0.0, +6.6] later; phase -0.7 [-2.1, +0.8]: cannot tell; "
            "less \u22120.129 [\u22120.174, \u22120.084], speedup **1.29x** (0.98-1.59) pays, 1.40x (1.10 to 1.70) pays; 39% [12%, 66%] more; "
            "0.9 [0.1, 0.5] more; -0.029 [-0.038, -0.021] (a tie); +0.2 [+0.1, +0.3] less; layers 4 (25-28), 8 of 8 (68%-100%)\n")
    found = quoted(text)
    assert [(q["value"], q["low"], q["high"], q["null"], q["word"]) for q in found] == [
        ("+0.050", "+0.020", "+0.079", 0.0, "more"), ("+3.3", "+0.0", "+6.6", 0.0, "later"), ("-0.7", "-2.1", "+0.8", 0.0, "cannot tell"),
        ("-0.129", "-0.174", "-0.084", 0.0, "less"), ("39", "12", "66", 0.0, "more"), ("0.9", "0.1", "0.5", 0.0, "more"),
        ("-0.029", "-0.038", "-0.021", 0.0, "tie"), ("+0.2", "+0.1", "+0.3", 0.0, "less"),
        ("1.29", "0.98", "1.59", 1.0, "pays"), ("1.40", "1.10", "1.70", 1.0, "pays")]
    said = [problems_of(q) for q in found]
    assert said[0] == said[2] == said[3] == said[4] == said[9] == []
    assert said[1] == ['"later", but the interval holds 0: the tool says cannot tell']  # [0.0, 6.6] holds 0
    assert said[5] == ["its value lies outside its interval"]
    assert said[6] == ['"tie", but the interval is off 0: the tool says less']
    assert said[7] == ['"less", but the interval is on the other side of 0']
    assert said[8] == ['"pays", but the interval holds 1: the tool says cannot tell']  # a ratio's null is 1
    table = "| measure | against each layer's KL when removed alone | against exact's pick |\n|---|---|---|\n| x | +0.7 [+0.4, +0.9] agrees | +0.4 [+0.1, +0.6] agrees |\n"
    rows = quoted(table)
    assert [q["column"] for q in rows] == ["against each layer's KL when removed alone", "against exact's pick"]
    assert problems_of(rows[0]) == [] and problems_of(rows[1]) == ['"agrees", but against the column\'s expected sign -1 the tool says opposite']
    assert agreement_word([-0.69, -0.05], -1) == "agrees" and agreement_word([-0.69, -0.05], +1) == "opposite"


@pytest.mark.parametrize("doc", [p.name for p in READ])
def test_no_doc_states_a_word_or_a_value_its_interval_does_not_give(doc):
    path = ROOT / doc if doc == "README.md" else DOCS / doc
    wrong = [f"line {q['line']}: {q['quote']!r} {problems}" for q in quoted(path.read_text()) for problems in [problems_of(q)] if problems]
    assert not wrong, f"{doc}: " + "; ".join(wrong)


def test_the_lint_reads_every_doc_and_the_readme():
    """How much it reads: every doc and the README, hundreds of quoted intervals (51 before issue 88)."""
    counts = {p.name: len(quoted(p.read_text())) for p in READ}
    assert "README.md" in counts and sum(counts.values()) >= 300, counts


def _section(doc: str, heading: str) -> str:
    text = (DOCS / doc).read_text()
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end >= 0 else len(text)]


def test_the_smollm2_tuned_lens_finding_says_the_ratio_range_its_table_gives():
    """docs/depth-use.md's SmolLM2 tuned-lens finding: each shown row's logit-lens KL over its tuned-lens
    KL; the headline must say their range (1.5-3.5x), not another (it once said 2-3x)."""
    heading = "## Finding: on SmolLM2-135M in fp32 (Wikipedia, a tuned lens of 20 steps"
    section = _section("depth-use.md", heading)
    rows = re.findall(rf"^\| (\d+) \| ({NUMBER}) \[[^]]+\] \| ({NUMBER}) \[[^]]+\] \|", section, flags=re.M)
    ratios = [float(logit) / float(tuned) for _, logit, tuned in rows]
    assert len(ratios) == 6
    headline = section.splitlines()[0]
    assert f"is {min(ratios):.1f}-{max(ratios):.1f}x the tuned lens's at the six layers shown" in headline, headline


def _stored(name: str) -> dict:
    return json.loads((DOCS / "findings" / name).read_text())


def test_the_continuations_finding_quotes_what_the_tool_gives_its_stored_figures():
    """docs/speculate.md, Finding 7: speculate's own comparison of the two drafts, recomputed from the
    per-prompt acceptances stored (`summary._versus` on them), must be the line the doc quotes; each
    held-out acceptance in its table, 1 - the mean held-out rejection stored; the picks as stored."""
    from depthcurse.speculate.report import speculate_verdicts
    from depthcurse.stats.intervals import mean_interval

    stored = _stored("speculate-continuations.json")
    section = _section("speculate.md", "### Finding 7")
    by_prompt = stored["speculate_acceptance_by_prompt"]
    differences = [p["self-draft #2"] - p["self-draft"] for p in by_prompt.values()]
    interval = mean_interval(differences)
    versus = {"self-draft #2": {"against": "self-draft", "difference": sum(differences) / len(differences), "interval": interval,
                                "prompts": len(differences), "verdict": difference_word(interval)}}
    (line,) = [v for v in speculate_verdicts({"run": {"temperature": 1.0}, "summary": {"drafts": {}, "plain": {}, "versus": versus}})
               if "against" in v]
    assert f'"{line}"' in " ".join(section.split())
    assert stored["picks"] == {"wiki/greedy/acceptance": [4, 16, 17, 18], "continuations/greedy/acceptance": [3, 5, 7, 22]}
    from depthcurse.stats.intervals import welch_interval  # decoding's acceptance against each held-out text's, as the section words it

    flat = " ".join(section.split())
    for pick, draft in (("3,5,7,22", "self-draft"), ("4,16,17,18", "self-draft #2")):
        decoded = [p[draft] for p in by_prompt.values()]
        for text in ("wiki", "continuations"):
            held = [1 - r for r in stored["held_out_rejection"][text][pick]]
            low, high = welch_interval(decoded, held)
            quote = f"{sum(decoded) / len(decoded) - sum(held) / len(held):+.3f} [{low:+.3f}, {high:+.3f}]"
            assert quote in flat, (pick, text, quote)
            assert (text == "continuations") == (difference_word([low, high]) == "cannot tell")
    assert "Welch's interval, 11 decoded prompts against 8 held-out windows" in flat and len(decoded) == 11 and len(held) == 8
    headline = section.splitlines()[0]  # its two claims, each the word the stored figures give
    assert versus["self-draft #2"]["verdict"] == "cannot tell" and "on held-out prompts the tool cannot tell which drafts better" in headline
    assert "the continuations predict the acceptance a draft meets, natural text does not" in headline
    for text, column in (("wiki", 2), ("continuations", 3)):
        for pick, rejection in stored["held_out_rejection"][text].items():
            row = next(r for r in section.splitlines() if r.startswith(f"| {pick.replace(',', ', ')} |"))
            assert row.split(" | ")[column] == f"{1 - sum(rejection) / len(rejection):.3f}", (text, pick)


def test_the_zoo_depth_map_finding_is_reports_own_summary_of_its_stored_runs():
    """docs/depth-use.md's 12 -> 24 map: `report`'s over-seeds table, made by `over_seeds.summarise_runs`
    from each run's stored figures, row for row in the doc; the largest dimension's share, the rows'
    spans and the best matches the prose gives, from the same store."""
    from depthcurse.depth.over_seeds import seeds_table, summarise_runs
    from depthcurse.report import markdown_table

    stored = _stored("zoo-depth-map.json")
    section = _section("depth-use.md", "## Finding: a 12-layer and a 24-layer Pre-LN model")
    summary = summarise_runs({"pre, 12 layers -> pre, 24 layers": [r["figures"] for r in stored["runs"]]}, kind="map", score=stored["score"])
    rows = [line for line in markdown_table(seeds_table(summary, "depth-map")).splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 6 and all(row in section for row in rows), [row for row in rows if row not in section]
    deep, shallow = (max(r["largest_dimension_share"][side] for r in stored["runs"]) for side in ("deep", "shallow"))
    assert f"holds at most {deep:.0%} of its\n  variance ({shallow:.0%} of the shallow models')" in section
    spans = [s for r in stored["runs"] for s in r["rows"]["r2_dims"]["row_spans"][1:]]
    assert f"a row spans {min(spans):.2f}-{max(spans):.2f} over the 24 deep layers" in " ".join(section.split())
    assert [r["best"] for r in stored["runs"]] == [[2] * 12, [1] + [2] * 9 + [0, 0], [1] * 5 + [4] * 7]
    headline = section.splitlines()[0]  # "the best match sits early, not on the diagonal": every best match in the deep model's first fifth
    assert "the best match sits early, not on the diagonal" in headline and max(j for r in stored["runs"] for j in r["best"]) < 24 / 5


def test_the_zoo_depth_use_finding_is_reports_own_summary_of_its_stored_runs():
    """docs/depth-use.md's norm zoo: `report`'s two tables and its three lines, made by
    `over_seeds.summarise_runs` from each run's stored figures, every row and line in the doc; the
    tuned lens's claim (closer at every row of every run, and the ratio range) from the store."""
    from depthcurse.depth.over_seeds import differences_table, seeds_table, seeds_verdicts, summarise_runs
    from depthcurse.report import markdown_table

    stored = _stored("zoo-depth-use.json")
    section = _section("depth-use.md", "## Finding: in lns-train's 24-layer models")
    summary = summarise_runs(stored["groups"])
    for table in (seeds_table(summary, "depth-use"), differences_table(summary)):
        rows = [line for line in markdown_table(table).splitlines() if line.startswith("| ") and "---" not in line]
        assert len(rows) == 14 and all(row in section for row in rows), [row for row in rows if row not in section]
    lines = seeds_verdicts(summary)
    assert len(lines) == 3 and all(f"- {line}" in section for line in lines)
    headline = section.splitlines()[0]  # each claim of the headline is the word the tool's lines give its measure
    claims = {"lns": ("LNS settles the prediction earlier and its second half adds, changes and matters less than Pre-LN's",
                      {"half of the tokens settled, logit lens (layer)": "earlier", "attention ||a||/||h||, second half": "less",
                       "MLP ||m||/||h||, second half": "less", "influence on later layers, second half": "less",
                       "output KL when skipped, second half (nats)": "less"}),
              **{norm: ("Mix-LN's and HybridNorm's second-half MLPs add, change later work and matter more",
                        {"MLP ||m||/||h||, second half": "more", "influence on later layers, second half": "more",
                         "output KL when skipped, second half (nats)": "more"}) for norm in ("mix", "hybridnorm")}}
    for norm, (claim, words) in claims.items():
        (line,) = [line for line in lines if line.startswith(f"{norm}, 24 layers against pre")]
        assert claim in headline and all(f"{measure} {word} " in line for measure, word in words.items()), (norm, line)
    phases = {group: [run["phase"] for run in runs] for group, runs in stored["groups"].items()}
    found = [p for runs in phases.values() for p in runs if p is not None]
    assert set(found) == {1, 2} and phases["mix, 24 layers"].count(None) == 2 and sum(p is None for runs in phases.values() for p in runs) == 2
    assert "the phase transition is at layer 1-2 wherever the rule finds one (in two of Mix-LN's three runs it finds none)" in headline
    lens = [run for runs in stored["lens_comparison"].values() for run in runs]
    assert all(run["closer"] == run["rows"] == 23 for run in lens) and len(lens) == 12
    low, high = min(run["ratio_range"][0] for run in lens), max(run["ratio_range"][1] for run in lens)
    assert f"the logit lens's KL {low:.1f}-{high:.1f}x" in " ".join(section.split())
