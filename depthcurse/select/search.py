"""The contract a search meets, and the registry that finds one by name.

A search chooses which units to remove: k whole blocks, or (`sub-block` granularity) k attention
and k MLP branches, as EvoPress removes them by default. It is one class in one file: what it is
given (`SearchContext`: the space of removals, the scorer of any removal on the calibration
windows, whose every call is counted, the angular-distance pass where it reads the streams, the model
and the windows themselves where it runs a model of its own making (LaCo's and SWM's merges), a seed
and its own `Settings`) and what it gives (the chosen removal; the scorer keeps every removal it
scored with its score, and what that cost). `select`'s grid, its statistics and its report depend
on this contract and never on a search's name, as the heal loop depends on `heal.method`.

Where a search is found (`find_search`): the built-in ones, in `select/searches/`, one module
each, registered by defining them; outside ones by `module:Class` or `path/to/file.py:Class`, or
by name through the entry-point group `depthcurse.select_searches`. `--search-args key=value,...`
sets their settings (`name.key=value` for one search alone), as `--method-args` does a method's.

A removal is a tuple of units, sorted: block indices (`3, 7`) for whole blocks; `a3`, `m7` (the
attention branch of block 3, the MLP branch of block 7) for sub-blocks. `key` writes one as the
results files do.
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, ClassVar

from depthcurse.errors import DepthcurseError
from depthcurse.granularity import GRANULARITIES_TAKEN, check_granularity_taken
from depthcurse.plugins import changed_settings, entry_points_of, load_outside, parse_args, scoped, settings_fields, typed

ENTRY_POINTS = "depthcurse.select_searches"
# layer: k whole blocks; sub-block: k attention and k MLP branches (EvoPress's); branch: k branches in
# all, of either kind (the space SWIFT's and Draft & Verify's skip-set searches draw from). Their
# meanings, one for every command, are `granularity.GRANULARITY_MEANINGS`.
GRANULARITIES = GRANULARITIES_TAKEN["select"]
READS = ("objective", "streams", "model", "nothing")  # what a search needs: the scorer, the angular pass, the model itself (a merge's), none
# What a removal's calibration score can be, in the order `select.json` keeps them: next-token loss, KL
# from the unpruned model, rejection (1 - teacher-forced top-1 agreement with the unpruned model: under
# greedy decoding, the share of a self-draft's tokens the whole model would not accept), and the
# expected time per token of self-speculative decoding with that draft (1 / its expected speedup,
# from the agreement and this machine's measured costs). A search minimises each.
OBJECTIVES = ("ppl", "kl", "acceptance", "speedup")

Unit = int | str  # a block index (layer granularity), or "a3" / "m3" (an attention or MLP branch)
Removal = tuple  # of units, sorted


def key(removal) -> str:
    """A removal as the results files write it: `3,7` or `a3,m7`."""
    return ",".join(map(str, removal))


def parse_key(text: str) -> Removal:
    """`key`'s text back to a removal."""
    parts = [p for p in text.split(",") if p]
    return tuple(int(p) if p.lstrip("-").isdigit() else p for p in parts)


def canonical(units, granularity: str) -> Removal:
    """`units` in the one order every removal is kept in: blocks ascending; sub-blocks attention
    first, each kind by block."""
    if granularity == "layer":
        return tuple(sorted(int(u) for u in units))
    return tuple(sorted(units, key=lambda u: (u[0], int(u[1:]))))


@dataclass(frozen=True)
class Space:
    """What a search chooses from: `n` blocks, `k` removed (sub-blocks: k attention and k MLP
    branches, EvoPress's default), and which units may go (`allowed`, all by default)."""

    n: int
    k: int
    granularity: str = "layer"
    timing: object = None  # `estimate.PassTiming`: what a pass costs here, for a budget's "about how long" (None: not measured)

    def sets_text(self) -> str:
        if self.granularity == "branch":
            return f"C({2 * self.n}, {self.k}) (k branches, attention or MLP)"
        return f"C({self.n}, {self.k})" + ("" if self.granularity == "layer" else "^2 (k attention and k MLP branches)")

    def units(self, kind: str | None = None) -> list[Unit]:
        """Every unit a removal may take (of one kind, "a" or "m", for sub-blocks)."""
        if self.granularity == "layer":
            return list(range(self.n))
        kinds = (kind,) if kind else ("a", "m")
        return [f"{t}{i}" for t in kinds for i in range(self.n)]

    def sets(self) -> int:
        """How many removals there are: C(n, k), C(n, k)^2 for sub-blocks, C(2n, k) for branches."""
        if self.granularity == "branch":
            return math.comb(2 * self.n, self.k)
        return math.comb(self.n, self.k) ** (1 if self.granularity == "layer" else 2)

    def every(self):
        """Every removal, in lexicographic order."""
        if self.granularity == "layer":
            return itertools.combinations(range(self.n), self.k)
        if self.granularity == "branch":
            return itertools.combinations(self.units(), self.k)
        return (tuple(f"a{i}" for i in a) + tuple(f"m{i}" for i in m)
                for a in itertools.combinations(range(self.n), self.k) for m in itertools.combinations(range(self.n), self.k))

    def why_bad_units(self, units) -> str | None:
        """Why `units` are not units of this space, each once (None: they are), whatever their number."""
        units = list(units)
        if len(set(units)) != len(units):
            return f"it names a unit twice ({key(units)})"
        if self.granularity == "layer":
            bad = [u for u in units if not (isinstance(u, int) and not isinstance(u, bool) and 0 <= u < self.n)]
            return f"{bad[0]!r} is not a block index 0-{self.n - 1}" if bad else None
        bad = [u for u in units if not (isinstance(u, str) and u[:1] in "am" and u[1:].isdigit() and int(u[1:]) < self.n)]
        return f"{bad[0]!r} is not a sub-block (a0-a{self.n - 1}, m0-m{self.n - 1})" if bad else None

    def why_illegal(self, removal, any_count: bool = False) -> str | None:
        """Why `removal` is not one of this space's (None: it is); `any_count`: of any number of
        branches from one to all but one (a search that chooses how many, as Draft & Verify's)."""
        units = list(removal)
        bad = self.why_bad_units(units)
        if bad is not None:
            return bad
        if self.granularity == "layer":
            return None if len(units) == self.k else f"it removes {len(units)} blocks, not k = {self.k}"
        if self.granularity == "branch":
            if any_count:
                return None if 1 <= len(units) < 2 * self.n else f"it removes {len(units)} branches, not 1 to {2 * self.n - 1}"
            return None if len(units) == self.k else f"it removes {len(units)} branches, not k = {self.k}"
        counts = {t: sum(1 for u in units if u[0] == t) for t in "am"}
        return None if counts == {"a": self.k, "m": self.k} else (
            f"it removes {counts['a']} attention and {counts['m']} MLP branches, not k = {self.k} of each")

    def check(self) -> "Space":
        check_granularity_taken("select", self.granularity)
        most = 2 * self.n if self.granularity == "branch" else self.n
        if not 1 <= self.k < most:
            raise DepthcurseError(f"--k {self.k} is out of range: the model has {self.n} layers (1-{most - 1}" +
                                  (f" branches of its {2 * self.n})" if self.granularity == "branch" else ")"))
        return self


@dataclass
class SearchContext:
    """What `select` gives a search to work with."""

    space: Space
    objective: str  # what `score` returns (`OBJECTIVES`: mean next-token loss, mean KL, rejection, expected time per token), lower better
    score: Callable[[Removal], float]  # a removal's objective on every calibration window (kept, counted)
    score_many: Callable[[list], list[float]]  # many removals at once (the prefix walk: each shared prefix computed once)
    score_on: Callable[[Removal, list[int], int], float]  # on some windows only: (removal, window indices, tokens of the last one)
    windows: int  # calibration windows
    window_tokens: int  # tokens a window scores (its next-token predictions)
    streams: Callable[[], object]  # the angular-distance pass over the calibration windows (`angular.AngularResult`), made once when asked
    seed: int = 1234
    phase: Callable[[str], None] = field(default=lambda text: None)
    notes: list[str] = field(default_factory=list)  # what a search says of how it ran (a scaled stage, a budget): kept in the cell
    model: object = None  # the model in memory, every layer in place, for a search that runs what it makes (`reads = "model"`: a merge's)
    calibration: object = None  # the calibration windows' token ids (windows x tokens), which `score` measures on
    # many removals on one minibatch at once (under torchrun shared over the ranks); by default `score_on` on each
    score_on_many: Callable[[list, list[int], int], list[float]] | None = None

    def __post_init__(self):
        if self.score_on_many is None and self.score_on is not None:
            self.score_on_many = lambda removals, windows, last: [self.score_on(r, windows, last) for r in removals]


class Bound:
    """A loop that must end, held to it: `step()` each time round, and past `limit` steps one line
    naming the procedure instead of a hang (a bug, or an input the loop cannot take)."""

    def __init__(self, limit: int, procedure: str):
        self.limit, self.procedure, self.steps = limit, procedure, 0

    def step(self, where: str = "") -> None:
        self.steps += 1
        if self.steps > self.limit:
            raise DepthcurseError(f"{self.procedure} did not end within its bound of {self.limit:,} steps{f' ({where})' if where else ''}: "
                                  "a loop that cannot end, stopped (please report it with the command)")


@dataclass
class NoSettings:
    """A search with nothing to set."""


class Search:
    """A way to choose which units go. Subclass it, name it, and give it `run`; `Settings` (a
    dataclass whose defaults are its paper's) holds what `--search-args` sets."""

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""  # in words, for tables
    source: ClassVar[str] = ""  # the paper, and the authors' code it follows
    reads: ClassVar[str] = "objective"  # what it needs (`READS`): a cell per objective when "objective"
    granularities: ClassVar[tuple[str, ...]] = ("layer",)
    chooses_k: ClassVar[bool] = False  # it decides how many branches go (`branch` granularity), `--k` aside
    seeded: ClassVar[bool] = False  # its choice depends on the seed (`select --seeds` reruns it under others)
    Settings: ClassVar[type] = NoSettings
    builtin: ClassVar[bool] = False

    def __init__(self, settings=None):
        self.settings = settings if settings is not None else self.Settings()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.name and cls.__module__.startswith("depthcurse.select.searches."):
            cls.builtin = True
            BUILTIN[cls.name] = cls
        if "run" in cls.__dict__:
            cls.run = _checked_run(cls.__dict__["run"], ours=cls.__module__.startswith("depthcurse."))
        if "check" in cls.__dict__:
            cls.check = _checked_check(cls.__dict__["check"], ours=cls.__module__.startswith("depthcurse."))

    def check(self, space: Space) -> None:
        """One clear error, before any work, where this search cannot run on `space` (a budget it
        cannot keep, a setting that cannot work)."""

    def passes(self, space: Space, tokens: int) -> tuple[float, float] | None:
        """The block and head passes over the calibration windows (`tokens` in all) it expects to run
        (`estimate`), from its settings and the space alone; None: it cannot say."""
        return None

    def run(self, ctx: SearchContext) -> Removal:
        raise NotImplementedError


BUILTIN: dict[str, type[Search]] = {}


def _named(search) -> str:
    return getattr(search, "name", "") or type(search).__name__


def _checked_check(fn, ours: bool):
    @functools.wraps(fn)
    def check(self, space):
        try:
            return fn(self, space)
        except DepthcurseError:
            raise
        except (Exception, SystemExit) as exc:
            if ours:
                raise
            if isinstance(exc, SystemExit):
                raise DepthcurseError(f"--search {_named(self)}: its check() called sys.exit({exc.code!r}): raise "
                                      "depthcurse.errors.DepthcurseError with the reason instead") from None
            raise DepthcurseError(f"--search {_named(self)}: its check() raised {type(exc).__name__}: {exc}") from exc
    return check


def _plain_units(removal, granularity: str) -> tuple:
    """A removal with numpy's (or any) integers as Python ints, for whole blocks."""
    if granularity != "layer":
        return tuple(removal)
    return tuple(int(u) if isinstance(u, numbers.Integral) and not isinstance(u, bool) else u for u in removal)


def checked_asks(search, space: Space, removals) -> list[Removal]:
    """The removals a search asks the scorer for, held to the rules before any is run: units of the
    space (numpy integers taken as blocks), each once, at most k of them (of each kind for
    sub-blocks; all but one branch for a search that chooses how many); one line naming the search
    and the rule where one is broken."""
    out = []
    most = 2 * space.n - 1 if getattr(search, "chooses_k", False) and space.granularity == "branch" else space.k
    for removal in removals:
        if not isinstance(removal, (tuple, list)):
            raise DepthcurseError(f"--search {_named(search)} asked the scorer for {removal!r}: a removal is a tuple of units")
        units = _plain_units(removal, space.granularity)
        why = space.why_bad_units(units)
        if why is None:
            counts = [len(units)] if space.granularity != "sub-block" else [sum(1 for u in units if u[0] == t) for t in "am"]
            if max(counts, default=0) > most:
                why = f"it removes {len(units)} units, more than " + (f"k = {most}" if most == space.k else f"the {most} a removal may take") + \
                      (" of a kind" if space.granularity == "sub-block" else "")
        if why is not None:
            raise DepthcurseError(f"--search {_named(search)} asked the scorer for {key(units)}, which is no removal of this grid: {why}")
        out.append(canonical(units, space.granularity) if units else ())
    return out


def _checked_run(fn, ours: bool):
    """`run`, held to the contract: it gives a removal of the space (k units of its granularity,
    each once), which the grid then keeps; an outside search's error is one line naming it."""

    @functools.wraps(fn)
    def run(self, ctx: SearchContext):
        try:
            chosen = fn(self, ctx)
        except DepthcurseError:
            raise
        except (Exception, SystemExit) as exc:
            if ours:
                raise
            if isinstance(exc, SystemExit):  # its exit would end select with no line, every finished cell's work unsaid
                raise DepthcurseError(f"--search {_named(self)}: its run() called sys.exit({exc.code!r}): a search returns its removal, "
                                      "or raises depthcurse.errors.DepthcurseError with the reason") from None
            raise DepthcurseError(f"--search {_named(self)}: its run() raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(chosen, (tuple, list)):
            raise DepthcurseError(f"--search {_named(self)}: run() must return the removal it chose (a tuple of units), got {type(chosen).__name__}")
        chosen = _plain_units(chosen, ctx.space.granularity)
        why = ctx.space.why_illegal(chosen, any_count=getattr(self, "chooses_k", False) and ctx.space.granularity == "branch")
        if why is not None:
            raise DepthcurseError(f"--search {_named(self)}: run() chose no removal of this grid: {why}")
        return canonical(chosen, ctx.space.granularity)

    return run


# --------------------------------------------------------------------------- finding one
def _outside(spec: str) -> type[Search]:
    cls = load_outside(spec, Search, "--search", "a search", "depthcurse.select.Search")
    builtin = BUILTIN.get(cls.name)
    if builtin is not None and builtin is not cls:
        raise DepthcurseError(f"--search {spec}: its name {cls.name!r} is the built-in search's: give {spec.rpartition(':')[2]} a name of its own")
    if not cls.name:
        raise DepthcurseError(f"--search {spec}: give {cls.__name__} a name (the class attribute `name`): the results name each search by it")
    if cls.reads not in READS:
        raise DepthcurseError(f"--search {spec}: its `reads` must be one of {', '.join(READS)}, got {cls.reads!r}")
    if "run" not in {name for klass in cls.__mro__ if klass is not Search and issubclass(klass, Search) for name in klass.__dict__}:
        raise DepthcurseError(f"--search {spec}: {cls.__name__} has no run(ctx): a search gives the removal it chooses from run (see depthcurse.select.Search)")
    return cls


def find_search(spec: str) -> type[Search]:
    """The class a search name, `module:Class` or `file.py:Class` names."""
    if ":" in spec:
        return _outside(spec)
    if spec in BUILTIN:
        return BUILTIN[spec]
    plugged = entry_points_of(ENTRY_POINTS).get(spec)
    if plugged is not None:
        cls = plugged.load()
        if not (isinstance(cls, type) and issubclass(cls, Search)):
            raise DepthcurseError(f"--search {spec}: the entry point {plugged.value} is not a depthcurse.select.Search")
        return cls
    raise DepthcurseError(f"--search {spec}: use {', '.join(search_names())}, or module:Class / file.py:Class for your own")


def search_names() -> list[str]:
    return sorted({*BUILTIN, *entry_points_of(ENTRY_POINTS)})


def parse_search_args(text: str | None) -> dict[str, str]:
    return parse_args(text, "--search-args", "exact.max_sets=100000,evo.offspring=16")


def build_searches(specs: tuple[str, ...], args: dict[str, str] | None = None) -> dict[str, Search]:
    """Each search `specs` names, by its name, with its settings from `args` (`key=value` for
    every search that has the key, `name.key=value` for one alone; a key none has is an error)."""
    args = dict(args or {})
    classes = {spec: find_search(spec) for spec in specs}
    names = {}
    for spec, cls in classes.items():
        if cls.name in names:
            raise DepthcurseError(f"--search {','.join(specs)}: {names[cls.name]} and {spec} are both named {cls.name!r}: give one a name of its own")
        names[cls.name] = spec
    built, used = {}, set()
    for spec, cls in classes.items():
        own = {f.name for f in settings_fields(cls, "--search", "--search-args")}
        mine, taken = scoped(args, spec, cls.name, own, "--search-args")
        used |= taken
        settings = cls.Settings(**{k: typed(cls.Settings, k, v, cls.name, "--search-args") for k, v in mine.items()})
        built[cls.name] = cls(settings)
    unused = [name for name in args if name not in used]
    if unused:
        scope = unused[0].rpartition(".")[0]
        if scope:
            raise DepthcurseError(f"--search-args {unused[0]}: no search of --search {','.join(specs)} is {scope!r}")
        raise DepthcurseError(f"--search-args {unused[0]}: no search of --search {','.join(specs)} has that setting")
    return built


def settings_text(search: Search) -> str:
    """A search's settings away from their defaults, as `--search-args` takes them."""
    return changed_settings(search.settings)
