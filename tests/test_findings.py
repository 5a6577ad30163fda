"""Findings whose words follow from their numbers (issue 79, item 6).

- Every comparison a doc quotes in the tool's form, `VALUE [LOW, HIGH] WORD`, says the word the tool
  gives that interval (`stats.verdicts`): "more" / "later" / "further" above 0, "less" / "earlier" /
  "closer" below, "apart" / "agrees" / "opposite" off 0, "cannot tell" on it.
- Each published comparison whose figures are stored (`docs/findings/*.json`: the figures of every
  run it rests on) is recomputed by the code that printed it, and the doc must hold the tool's own
  lines and cells: a doc edited by hand, or figures that moved, fail here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from depthcurse.stats.verdicts import agreement_word, difference_word

DOCS = Path(__file__).resolve().parent.parent / "docs"
NUMBER = r"[-+]?\d+(?:\.\d+)?"
QUOTED = re.compile(rf"(?P<value>{NUMBER})[^\[\n]{{0,12}}\[(?P<low>{NUMBER}),\s*(?P<high>{NUMBER})\]\)?:?\s*\**\s*"
                    r"(?P<word>apart|cannot tell|more|less|agrees|opposite|closer|further|earlier|later)\b")
WORDS = {"more": ("more", "less"), "less": ("more", "less"), "later": ("later", "earlier"), "earlier": ("later", "earlier"),
         "further": ("further", "closer"), "closer": ("further", "closer")}


def quoted_verdicts(text: str) -> list[tuple[str, float, float, str]]:
    """Every `VALUE [LOW, HIGH] WORD` in a text: (what was quoted, low, high, word)."""
    return [(m.group(0), float(m["low"]), float(m["high"]), m["word"]) for m in QUOTED.finditer(text)]


def word_for(low: float, high: float, word: str) -> str:
    """The word the tool gives [low, high] in the family of `word`."""
    if word in WORDS:
        return difference_word([low, high], *WORDS[word])
    if word in ("agrees", "opposite"):  # the expected side is the table's; off 0 is what the interval must say
        return word if difference_word([low, high]) != "cannot tell" else "cannot tell"
    if word == "apart":
        return "apart" if difference_word([low, high]) != "cannot tell" else "cannot tell"
    return difference_word([low, high])


def test_the_lint_reads_the_tools_form_and_tells_a_wrong_word_by_hand():
    found = quoted_verdicts("influence +0.050 [+0.020, +0.079] more; settling +3.3 [+0.0, +6.6] later; rho -0.42 [-0.69, -0.05] agrees; "
                            "phase -0.7 [-2.1, +0.8]: cannot tell")
    assert [(low, high, word) for _, low, high, word in found] == [(0.02, 0.079, "more"), (0.0, 6.6, "later"), (-0.69, -0.05, "agrees"),
                                                                  (-2.1, 0.8, "cannot tell")]
    assert [word_for(low, high, word) == word for _, low, high, word in found] == [True, False, True, True]  # [0.0, 6.6] holds 0
    assert word_for(-0.3, -0.1, "closer") == "closer" and word_for(-0.3, -0.1, "further") == "closer" and word_for(0.1, 0.2, "apart") == "apart"
    assert agreement_word([-0.69, -0.05], -1) == "agrees" and agreement_word([-0.69, -0.05], +1) == "opposite"


@pytest.mark.parametrize("doc", sorted(p.name for p in DOCS.glob("*.md")))
def test_no_doc_states_a_verdict_its_interval_does_not_give(doc):
    wrong = [quoted for quoted, low, high, word in quoted_verdicts((DOCS / doc).read_text()) if word_for(low, high, word) != word]
    assert not wrong, f"{doc}: {wrong}"


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
    lens = [run for runs in stored["lens_comparison"].values() for run in runs]
    assert all(run["closer"] == run["rows"] == 23 for run in lens) and len(lens) == 12
    low, high = min(run["ratio_range"][0] for run in lens), max(run["ratio_range"][1] for run in lens)
    assert f"the logit lens's KL {low:.1f}-{high:.1f}x" in " ".join(section.split())
