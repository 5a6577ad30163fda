"""`select`'s one config: what a run is (its texts, objectives, searches, windows, seed and
settings), checked before a model loads, and the names its cells and texts go by. Everything a
run does is derived from it (`grid.run_select`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from depthcurse.errors import DepthcurseError
from depthcurse.granularity import check_granularity_taken
from depthcurse.kept_state import identity_of
from depthcurse.select import searches as _builtin  # noqa: F401 (defines the built-in searches, which registers them)
from depthcurse.select.search import OBJECTIVES, Search, Space, build_searches
from depthcurse.text import text_source


@dataclass
class SelectConfig:
    k: int
    calibration: tuple[str, ...]  # text sources (wiki, c4, code, math, dialogue, a file) the choice is made on
    objectives: tuple[str, ...] | None = None  # None: not given (ppl where searches are given; the recipe's kl where not)
    searches: tuple[str, ...] | None = None  # names, or module:Class / file.py:Class of one's own; None: the recipe (`select.recipe`)
    calib_windows: int = 8
    eval_windows: int = 16
    seq_len: int = 128
    batch_size: int = 4
    task: str | None = None  # judged on it too (probes, commonsense, an lm-eval task), with `limit`
    limit: int | None = None
    seed: int = 1234
    granularity: str = "layer"  # or "sub-block": k attention and k MLP branches
    search_args: dict = field(default_factory=dict)  # --search-args, name.key -> value
    draft_tokens: int = 4  # gamma of the draft the speedup objective prices
    resamples: int | None = None  # bootstrap resamples of the calibration windows each search reruns on; None: the recipe's, else none
    seeds: tuple[int, ...] = ()  # other seeds each seeded search (evo, random, swift) reruns under, on every window
    budget: float = 30.0  # minutes: the recipe runs exact where its estimate fits, else evo
    held_out: str = "windows"  # what a choice is judged on: other windows of the same documents, or windows of other documents

    @property
    def recipe(self) -> bool:
        return self.searches is None

    def built(self) -> dict[str, Search]:
        """The searches, by name, their settings set."""
        return build_searches(self.searches, self.search_args)

    def checked(self, n_layers: int | None = None, space: Space | None = None) -> "SelectConfig":
        """The config with its defaults filled in, or one line on what is wrong with it; given the
        model's layers (or the space, with what a pass costs here), every search's own check of the
        space too (a budget it cannot keep)."""
        if self.k < 1:
            raise DepthcurseError(f"--k must be at least 1, got {self.k}")
        check_granularity_taken("select", self.granularity)
        if self.resamples is not None and self.resamples < 0:
            raise DepthcurseError(f"--resamples must be 0 or more, got {self.resamples}")
        if self.resamples == 1:
            raise DepthcurseError("--resamples 1: one resample says nothing of how often a pick comes back: give 0, or 2 or more")
        if len(set(self.seeds)) != len(self.seeds) or self.seed in self.seeds:
            raise DepthcurseError(f"--seeds {','.join(map(str, self.seeds))}: each must be given once, and differ from --seed {self.seed}")
        if self.held_out not in ("windows", "documents"):
            raise DepthcurseError(f"--held-out {self.held_out}: use windows (other windows of the same documents) or documents (other documents)")
        if self.budget <= 0:
            raise DepthcurseError(f"--budget must be more than 0 minutes, got {self.budget:g}")
        if self.recipe:
            if self.granularity != "layer":
                raise DepthcurseError(f"--granularity {self.granularity} needs --search: the recipe (greedy, then exact or evo) removes whole blocks")
            # checked as greedy's would be (every other check the same), its searches left for the run to choose
            return replace(replace(self, searches=("greedy",)).checked(n_layers, space), searches=None, objectives=self.objectives)
        if not self.searches:
            raise DepthcurseError("--search (none): give at least one search")
        twice = sorted({g for g in self.searches if self.searches.count(g) > 1})
        if twice:
            raise DepthcurseError(f"--search names {', '.join(twice)} more than once: each cell would be measured twice, as if two")
        searches = self.built()
        for name, search in searches.items():
            if self.granularity not in search.granularities:
                raise DepthcurseError(f"--search {name} removes {' or '.join(search.granularities)} units, not {self.granularity} "
                                      f"(--granularity {self.granularity} takes {', '.join(n for n, s in searches.items() if self.granularity in s.granularities) or 'exact, evo, random, last'})")
        if self.objectives is not None and not any(s.reads == "objective" for s in searches.values()):
            raise DepthcurseError(f"--objective {','.join(self.objectives)}: no search of --search {','.join(self.searches)} reads an objective "
                                  f"(only {', '.join(n for n, s in sorted(searches.items()) if s.reads == 'objective') or 'greedy, one-shot, exact, evo and random'} do)")
        objectives = self.objectives if self.objectives is not None else ("ppl",)
        bad = [o for o in objectives if o not in OBJECTIVES]
        if bad or not objectives:
            raise DepthcurseError(f"--objective {','.join(objectives) or '(none)'}: use {', '.join(OBJECTIVES)}")
        if not self.calibration:
            raise DepthcurseError("--calibration: give at least one text (wiki, c4, code, math, dialogue, continuations, or a file)")
        for source in self.calibration:  # the model's own continuations of a prompts file: the file, before a model loads
            if source.startswith("continuations:") and not Path(source.split(":", 1)[1]).expanduser().is_file():
                raise DepthcurseError(f"--calibration {source}: no such prompts file")
        if "auto" in self.calibration:  # what `auto` is here, kept in the record, and caught where the same text is named twice
            return replace(self, calibration=tuple(text_source(c) for c in self.calibration)).checked(n_layers, space)
        for name, given in (("--calibration", [str(Path(c).expanduser().resolve()) if Path(c).suffix else c for c in self.calibration]),
                            ("--objective", objectives)):
            twice = sorted({g for g in given if given.count(g) > 1})
            if twice:
                raise DepthcurseError(f"{name} names {', '.join(twice)} more than once: each cell would be measured twice, as if two")
        if self.limit is not None and self.task is None:
            raise DepthcurseError("--limit applies to --task, which is not given")
        if self.task is not None and self.granularity != "layer":
            raise DepthcurseError(f"--task judges whole-block removals (prune's reuse engine); with --granularity {self.granularity} the choices "
                                  "are judged on the held-out windows alone: leave --task out")
        for name in ("calib_windows", "eval_windows", "batch_size"):
            if getattr(self, name) < 1:
                raise DepthcurseError(f"--{name.replace('_', '-')} must be at least 1")
        if self.eval_windows < 2:
            raise DepthcurseError("--eval-windows must be at least 2: the intervals need paired windows")
        if self.seq_len < 8:
            raise DepthcurseError("--seq-len must be at least 8")
        if self.draft_tokens < 1:
            raise DepthcurseError(f"--draft-tokens must be at least 1, got {self.draft_tokens}")
        if self.draft_tokens != SelectConfig.draft_tokens and "speedup" not in objectives:
            raise DepthcurseError(f"--draft-tokens {self.draft_tokens} prices a draft for --objective speedup, which is not asked")
        if n_layers is not None or space is not None:
            space = (space or Space(n_layers, self.k, self.granularity)).check()
            for search in searches.values():
                search.check(space)
        return replace(self, objectives=objectives)

    def cells(self) -> list[tuple[str, str, str]]:
        """(calibration, search, objective) of every cell; a search that reads no objective is one
        cell per text, its objective "-"."""
        searches = self.built()
        return [(c, name, o) for c in self.calibration for name, search in searches.items()
                for o in (self.objectives if search.reads == "objective" else ("-",))]

    def identity(self) -> dict:
        """What a run is, as `select.json` keeps it: every field (`kept_state`), but the resamples and
        seeds, which add to a run rather than change it (a finished run may be given more)."""
        return identity_of(self, leave_out={"resamples", "seeds"})


def source_labels(sources) -> dict[str, str]:
    """A short name for each calibration text that no other shares: a source's own name (wiki, code)
    or a file's name without its suffix, with as many of its folders before it as it takes to tell
    two files of one name apart (a/lee, b/lee)."""
    parts = {s: (Path(s).expanduser().resolve().with_suffix("").parts if Path(s).suffix else (s,)) for s in sources}
    out = {}
    for s, p in parts.items():
        depth = 1
        while depth < len(p) and any(o != s and parts[o][-depth:] == p[-depth:] for o in parts):
            depth += 1
        out[s] = "/".join(p[-depth:])
    return out


def cell_name(cell, labels: dict[str, str]) -> str:
    c, s, o = cell
    return f"{labels[c]}/{s}" + (f"/{o}" if o != "-" else "")
