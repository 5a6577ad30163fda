"""The contract a recovery method meets, and the registry that finds one by name.

A method is one class in one file: what it needs (the model in memory with every layer, the
layers removed, calibration or training text through `HealContext`, its own `Settings`), and
what it gives (the model healed in memory, by `applied`; the cost; the healed checkpoint, by
folding or merging into a copy of the weights, `finalize`, with its new layers `placed`). The
heal loop, the comparison, the reports and the cards depend on this contract and never on a
method's name, as lm-eval's evaluator depends on its `api/` and not on a task.

Where a method is found (`find_method`): the built-in ones, in `heal/methods/`, one module each,
registered by defining them; outside ones by `module:Class` or `path/to/file.py:Class` (as
`lm_eval --include_path` takes a folder, and torch.hub `module:entry`), or by name through the
Python entry-point group `depthcurse.heal_methods`, which is what a package installs (as pytest
finds plugins). A composition `a+b` (the first's changes, then the second trained on top) is
`Compose`, not a name of its own.

A method's settings are a dataclass whose defaults are its paper's. `--method-args
key=value,...` (lm-eval's `--model_args` form) sets them; `method.key=value` sets one method's
alone when several run; the command line's common options (`--lora-rank`, `--calib-tokens`, ...)
set the field of the same name wherever a method has one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar, Iterator

import torch
from torch import nn

from depthcurse.errors import DepthcurseError
from depthcurse.forecast import Forecast, following
from depthcurse.plugins import changed_settings, entry_points_of, load_outside, parse_args, scoped, typed
from depthcurse.plugins import settings_fields as plugin_settings_fields
from depthcurse.runtime import World
from depthcurse.surgery import removed_layers

ENTRY_POINTS = "depthcurse.heal_methods"


@dataclass
class NoSettings:
    """A method with nothing to set."""


@dataclass
class HealContext:
    """What a heal gives a method to work with."""

    model: nn.Module  # the transformers model in memory, every layer in place
    layers: tuple[int, ...]  # removed, sorted
    calibration: Callable[[int], list[torch.Tensor]]  # tokens -> this rank's share of micro-batches of token ids holding that many in all
    world: World = field(default_factory=World)
    seed: int = 1234
    phase: Callable[[str], None] = lambda text: None
    earlier: list["Method"] = field(default_factory=list)  # the methods applied before this one (a composition's)
    note: Callable[[str], None] = lambda text: None  # a line between the progress lines: a phase's forecast
    forecasts: dict = field(default_factory=dict)  # each phase's forecast, by what it counts (the record keeps their summaries)

    def steps(self, what: str, plan) -> Iterator:
        """The plan's steps, for a method's phase that loops (its calibration batches): each said in the
        phase line ("what (3/8)"), and a forecast after the first (`forecast.Forecast`) kept by `what`."""
        forecast = self.forecasts[what] = Forecast(what, say=self.note)
        for index, step in forecast.over(plan):
            self.phase(f"{what} ({index + 1}/{len(plan)})")
            yield step

    def hear(self, what: str) -> Callable[[int, int], None]:
        """The same for work that reports `(done, total)` itself (`linear.estimate_maps`)."""
        heard = following(what, self.note)

        def on(done: int, total: int) -> None:
            self.forecasts[what] = heard(done, total)
            self.phase(f"{what} ({done}/{total})")

        return on

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @contextlib.contextmanager
    def student(self, method: "Method") -> Iterator[nn.Module]:
        """The model as the healed one while `method` trains: the earlier methods' changes and its
        own on, the layers it removes gone."""
        with contextlib.ExitStack() as stack:
            for m in [*self.earlier, method]:
                stack.enter_context(m.applied(self.model))
            stack.enter_context(removed_layers(self.model, tuple(method.removes(self.layers))))
            yield self.model

    @contextlib.contextmanager
    def teacher(self, method: "Method") -> Iterator[nn.Module]:
        """The unpruned model exactly: every layer, the earlier methods' changes and `method`'s off."""
        with contextlib.ExitStack() as stack:
            for m in [*self.earlier, method]:
                stack.enter_context(m.bypassed(self.model))
            yield self.model


class Method:
    """One way to win back a removal. Subclasses set the class attributes and override what they
    do; what they leave is the plain removal (`drop`)."""

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""  # the tables' and figures' name: "linear map (ReplaceMe)"
    source: ClassVar[str] = ""  # the paper and its code
    Settings: ClassVar[type] = NoSettings
    trains: ClassVar[bool] = False  # whether `heal` runs its training loop on `objective`
    loss_name: ClassVar[str] = ""  # what the training loss is, for the log and the figure
    next_token_loss: ClassVar[bool] = True  # a training loss on the next-token scale (diverged past 2 ln V)
    builtin: ClassVar[bool] = False

    def __init__(self, settings=None):
        self.settings = settings if settings is not None else self.Settings()
        self.check_settings()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.name and cls.__module__.startswith("depthcurse.heal.methods."):
            cls.builtin = True
            BUILTIN[cls.name] = cls
        for hook in HOOKS:  # the contract checked where it is used: see `_checked`
            if hook in cls.__dict__ and callable(cls.__dict__[hook]):
                setattr(cls, hook, _checked(hook, cls.__dict__[hook], ours=cls.__module__.startswith("depthcurse.")))

    # --- before anything runs
    def check_settings(self) -> None:
        """One clear error for a setting out of range (the command line's option names)."""

    def check(self, model: nn.Module, layers: tuple[int, ...]) -> None:
        """One clear error where this model's architecture cannot take the method."""

    # --- what it is, in words and numbers
    def describe(self) -> str:
        """How it healed, in a few words with the settings that mattered."""
        return self.title or self.name

    def changes(self, layers: tuple[int, ...]) -> str:
        """What the saved checkpoint holds besides the removal: which weights changed, what was put in."""
        return "nothing besides the removal"

    def removes(self, layers: tuple[int, ...]) -> tuple[int, ...]:
        """The layers the healed model lacks (a new layer in a run's place keeps that place)."""
        return tuple(layers)

    def untouched(self, layers: tuple[int, ...]) -> int:
        """How many first blocks compute exactly as in the unpruned model (a distillation's
        teacher and student share them)."""
        return min(layers)

    def cost(self, model: nn.Module, layers: tuple[int, ...]) -> dict:
        """Parameters trained, added to the model, and solved for (estimated without training)."""
        return {"trained_params": 0, "added_params": 0, "solved_params": 0}

    def recorded(self) -> dict:
        """Its settings, as a run records them."""
        return dataclasses.asdict(self.settings)

    # --- the heal
    def prepare(self, ctx: HealContext) -> None:
        """Estimate on calibration text, or put in what trains."""

    def state_dict(self) -> dict:
        """What `prepare` estimated, kept in the run's folder so that a resumed run reads it again
        (empty: nothing to keep, `prepare` runs again)."""
        return {}

    def load_state_dict(self, state: dict, ctx: HealContext) -> None:
        """In place of `prepare`, from `state_dict`."""
        raise NotImplementedError

    def objective(self, ctx: HealContext) -> nn.Module | None:
        """What `train.loop.train_step` trains: `(ids, targets) -> summed loss`, its trainable
        parameters the method's own."""
        return None

    def applied(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A context manager whose `with` gives `model` with this method's changes on (the layers
        are removed apart), and takes them off again on leaving."""
        return contextlib.nullcontext(model)

    def bypassed(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A context manager whose `with` gives `model` with this method's changes off (for
        changes that are on by default)."""
        return contextlib.nullcontext(model)

    # --- the checkpoint, made from a copy of the model and the method
    def extra_files(self, folder: Path, layers: tuple[int, ...]) -> dict:
        """Files besides the weights (LoRA's adapters in peft's format); what the card says of them."""
        return {}

    def finalize(self, model: nn.Module) -> nn.Module:
        """Its changes put into the weights of `model` (a copy), which it returns."""
        return model

    def placed(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A context manager whose `with` gives the finalized `model` with the new layers where
        they stand, for saving."""
        return contextlib.nullcontext(model)

    def modules(self) -> list[nn.Module]:
        """Modules of its own outside the model (new layers), cast with the model when it is saved."""
        return []


BUILTIN: dict[str, type[Method]] = {}

# The hooks a method may override; `Method.__init_subclass__` wraps each one a class defines.
HOOKS = ("check_settings", "check", "describe", "changes", "removes", "untouched", "cost", "recorded", "prepare", "state_dict",
         "load_state_dict", "objective", "applied", "bypassed", "extra_files", "finalize", "placed", "modules")
CONTEXTS = ("applied", "bypassed", "placed")  # hooks that give a context manager whose `with` gives the model


def _named(method) -> str:
    return getattr(method, "name", "") or type(method).__name__


@contextlib.contextmanager
def _blamed(method, hook: str, ours: bool, passing: BaseException | None = None) -> Iterator[None]:
    """An error raised inside is the method's `hook`'s: one line naming both. Ours show as they
    are (a bug of ours), and so does `passing` (the error of the code inside a `with` it gave)."""
    try:
        yield
    except DepthcurseError:
        raise
    except Exception as exc:
        if ours or exc is passing:
            raise
        raise DepthcurseError(f"--method {_named(method)}: its {hook}() raised {type(exc).__name__}: {exc}") from exc


def _checked(hook: str, fn: Callable, ours: bool) -> Callable:
    """`fn`, a method's `hook`, held to the contract: an error of a method from outside names the
    method and the hook (ours show as they are: a bug of ours), a context hook gives a context
    manager whose `with` gives the model it was given, `finalize` gives a model, and `objective`
    a module. Whatever breaks the rule is one line naming the method and the rule."""

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        with _blamed(self, hook, ours):
            out = fn(self, *args, **kwargs)
        if hook in CONTEXTS:
            if not (hasattr(out, "__enter__") and hasattr(out, "__exit__")):
                raise DepthcurseError(f"--method {_named(self)}: {hook}() must return a context manager (a @contextlib.contextmanager "
                                      f"that yields the model), got {type(out).__name__}")
            return _Entered(self, hook, args[0] if args else kwargs.get("model"), out, ours)
        if hook == "finalize" and not isinstance(out, nn.Module):
            raise DepthcurseError(f"--method {_named(self)}: finalize() must return the model it changed, got {type(out).__name__}")
        if hook == "objective" and out is not None and not isinstance(out, nn.Module):
            raise DepthcurseError(f"--method {_named(self)}: objective() must return an nn.Module ((ids, targets) -> summed loss) or None, "
                                  f"got {type(out).__name__}")
        return out

    return call


class _Entered(contextlib.AbstractContextManager):
    """A method's context hook, entered: it must give the model it was given (what the heal goes
    on to measure, train or save); an error in entering or leaving names the method and the hook,
    while an error of the code inside the `with` passes through as it is."""

    def __init__(self, method, hook: str, model, inner, ours: bool):
        self.method, self.hook, self.model, self.inner, self.ours = method, hook, model, inner, ours

    def __enter__(self):
        with _blamed(self.method, self.hook, self.ours):
            got = self.inner.__enter__()
        if got is not self.model:
            self.inner.__exit__(None, None, None)
            raise DepthcurseError(f"--method {_named(self.method)}: {self.hook}() must give the model it was given to the `with` "
                                  f"(`yield model`), it gave {'another ' if isinstance(got, type(self.model)) else ''}{type(got).__name__}")
        return got

    def __exit__(self, kind, exc, tb):
        with _blamed(self.method, self.hook, self.ours, passing=exc):
            return self.inner.__exit__(kind, exc, tb)


class Compose(Method):
    """Several methods one after another: each prepared (and trained) with the earlier ones'
    changes on, the saved checkpoint all of them folded in, the innermost first."""

    def __init__(self, members: list[Method]):
        self.members = members
        self.name = "+".join(m.name for m in members)
        self.title = ", then ".join(m.title or m.name for m in members)
        self.trains = any(m.trains for m in members)
        trained = [m for m in members if m.trains]
        if len(trained) > 1 or (trained and trained[0] is not members[-1]):
            raise DepthcurseError(f"--method {self.name}: only the last method of a composition may train (it trains on the others' changes)")
        self.loss_name = trained[0].loss_name if trained else ""
        self.next_token_loss = trained[0].next_token_loss if trained else True
        removed = {m.name: m.removes((0, 1)) for m in members}
        if len(set(removed.values())) > 1:
            raise DepthcurseError(f"--method {self.name}: its methods leave different layers in place ({', '.join(removed)}), so one cannot go on the other")
        self.settings = None

    def check(self, model, layers):
        for m in self.members:
            m.check(model, layers)

    def describe(self):
        return ", then ".join(m.describe() for m in self.members)

    def changes(self, layers):
        return "; then ".join(m.changes(layers) for m in self.members)

    def removes(self, layers):
        return self.members[0].removes(layers)

    def untouched(self, layers):
        return min(m.untouched(layers) for m in self.members)

    def cost(self, model, layers):
        costs = [m.cost(model, layers) for m in self.members]
        return {k: sum(c[k] for c in costs) for k in costs[0]}

    def recorded(self):
        return {m.name: m.recorded() for m in self.members}

    def prepare(self, ctx):
        for i, m in enumerate(self.members):
            m.prepare(dataclasses.replace(ctx, earlier=[*ctx.earlier, *self.members[:i]]))

    def state_dict(self):
        return {m.name: m.state_dict() for m in self.members}

    def load_state_dict(self, state, ctx):
        for i, m in enumerate(self.members):
            sub = dataclasses.replace(ctx, earlier=[*ctx.earlier, *self.members[:i]])
            if state.get(m.name):
                m.load_state_dict(state[m.name], sub)
            else:
                m.prepare(sub)

    def objective(self, ctx):
        last = self.members[-1]
        return last.objective(dataclasses.replace(ctx, earlier=[*ctx.earlier, *self.members[:-1]])) if last.trains else None

    def applied(self, model):
        return self._every("applied", model)

    def bypassed(self, model):
        return self._every("bypassed", model)

    @contextlib.contextmanager
    def _every(self, context: str, model):
        """Each member's `context` (applied, bypassed, placed) entered in turn."""
        with contextlib.ExitStack() as stack:
            for m in self.members:
                stack.enter_context(getattr(m, context)(model))
            yield model

    def extra_files(self, folder, layers):
        return {}  # a member's files would describe a model the others changed after

    def finalize(self, model):
        for m in reversed(self.members):  # the last put its changes inside the earlier ones' (adapters inside the MLP a map follows)
            model = m.finalize(model)
        return model

    def placed(self, model):
        return self._every("placed", model)

    def modules(self):
        return [mod for m in self.members for mod in m.modules()]


def at_least(settings, name: str, minimum: float = 1) -> None:
    """One clear line for a setting below its minimum, in the option's own name."""
    value = getattr(settings, name)
    if not value >= minimum:
        raise DepthcurseError(f"{said(name)} must be at least {minimum}, got {value}")


# --------------------------------------------------------------------------- finding one
def builtin_methods() -> dict[str, type[Method]]:
    """The methods that come with depthcurse, by name (`heal/__init__` imports `heal.methods`,
    whose modules register themselves by defining them)."""
    return dict(BUILTIN)


def _entry_point_methods() -> dict[str, object]:
    return entry_points_of(ENTRY_POINTS)


def _outside(spec: str) -> type[Method]:
    """`module:Class` or `path/to/file.py:Class`: a user's method, loaded without editing ours."""
    cls = load_outside(spec, Method, "--method", "a recovery method", "depthcurse.heal.Method")
    builtin = builtin_methods().get(cls.name)
    if builtin is not None and builtin is not cls:
        attr = spec.rpartition(":")[2]
        raise DepthcurseError(f"--method {spec}: its name {cls.name!r} is the built-in method's: give {attr} a name of its own")
    return cls


def find_method(spec: str) -> type[Method]:
    """The class a method name or `module:Class` names."""
    if ":" in spec:
        return _outside(spec)
    found = builtin_methods().get(spec)
    if found is not None:
        return found
    plugged = _entry_point_methods().get(spec)
    if plugged is not None:
        cls = plugged.load()
        if not (isinstance(cls, type) and issubclass(cls, Method)):
            raise DepthcurseError(f"--method {spec}: the entry point {plugged.value} is not a depthcurse.heal.Method")
        return cls
    known = sorted({*builtin_methods(), *_entry_point_methods()})
    raise DepthcurseError(f"unknown --method {spec!r}: use {', '.join(known)}, a+b (one after the other), or module:Class for your own")


def method_names() -> list[str]:
    return sorted({*builtin_methods(), *_entry_point_methods()})


# --------------------------------------------------------------------------- settings
def parse_method_args(text: str | None) -> dict[str, str]:
    """`key=value,key=value` (lm-eval's `--model_args`), kept as text until a method's field types it."""
    return parse_args(text, "--method-args", "ridge=0.1,calib_tokens=32768")


def _typed(cls, name: str, value, method: str):
    """`value` (text from the command line, or already typed) as the type of `cls`'s field `name`."""
    return typed(cls, name, value, method, "--method-args")


def settings_fields(cls: type[Method]) -> tuple:
    """The fields of `cls.Settings`, which the contract asks to be a dataclass."""
    return plugin_settings_fields(cls, "--method", "--method-args")


def configure(cls: type[Method], args: dict) -> Method:
    """An instance of `cls` with `args` (name -> value, text or typed) set on its settings."""
    known = {f.name for f in settings_fields(cls)}
    unknown = sorted(set(args) - known)
    if unknown:
        raise DepthcurseError(f"{said(unknown[0])} does not apply to --method {cls.name or cls.__name__} (its settings: {', '.join(sorted(known)) or 'none'})")
    settings = cls.Settings(**{k: _typed(cls.Settings, k, v, cls.name) for k, v in args.items()})
    return cls(settings)


def member_specs(spec: str) -> list[str]:
    """The methods `spec` composes (`a+b`), each as typed."""
    return [part.strip() for part in spec.split("+")] if ":" not in spec or "+" in spec else [spec.strip()]


def addresses(spec: str) -> set[str]:
    """What `scope.key` in `--method-args` may call the methods of `spec`: each as typed, and by
    the name the outputs print."""
    parts = member_specs(spec)
    return {*parts, *(find_method(p).name for p in parts)}


def build_method(spec: str, args: dict[str, str] | None = None, common: dict | None = None) -> Method:
    """The method `spec` names (`a+b` a composition), its settings from `args` (`key=value` for
    whichever member has the key, `name.key=value` for that member alone; a key no member has is
    an error) and from the command line's `common` options (set where a member has the field)."""
    args, common = dict(args or {}), {k: v for k, v in (common or {}).items() if v is not None}
    names = member_specs(spec)
    classes = [find_method(name) for name in names]
    members = []
    used = set()
    for name, cls in zip(names, classes):
        own = {f.name for f in settings_fields(cls)}
        given, taken = scoped(args, name, cls.name, own, "--method-args")  # by its spec as typed, or by its name as the outputs print it
        used |= taken
        members.append(configure(cls, {**{k: v for k, v in common.items() if k in own}, **given}))
    elsewhere = [k for k in args if k not in used and "." in k]
    if elsewhere:  # scoped to a method this run does not have: said, not dropped
        scope = elsewhere[0].rpartition(".")[0]
        raise DepthcurseError(f"--method-args {elsewhere[0]}: no method of --method {spec} is {scope!r} (address one by its name, "
                              f"{', '.join(c.name for c in classes)}, or by the spec typed, {', '.join(names)})")
    unused = [k for k in args if k not in used]
    if unused:
        key = unused[0]
        has = ", ".join(sorted({f.name for cls in classes for f in settings_fields(cls)})) or "none"
        raise DepthcurseError(f"{said(key)} does not apply to --method {spec} (its settings: {has})")
    return members[0] if len(members) == 1 else Compose(members)


# The command line's options for settings several methods have; any other is `--method-args key=...`.
FLAGS = {"lora_rank": "--lora-rank", "lora_alpha": "--lora-alpha", "lora_dropout": "--lora-dropout", "targets": "--targets", "adapt": "--adapt",
         "loss": "--loss", "calib_tokens": "--calib-tokens", "ridge": "--ridge"}


def said(key: str) -> str:
    """How a user gives the setting `key`."""
    return FLAGS.get(key, f"--method-args {key}")


def method_settings_text(method: Method) -> str:
    """The method's settings away from their defaults, as `--method-args` takes them."""
    if isinstance(method, Compose):
        return ",".join(f"{m.name}.{part}" for m in method.members for part in method_settings_text(m).split(",") if part)
    return changed_settings(method.settings)
