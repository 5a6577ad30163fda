"""What every registry of plug-ins shares (recovery methods, searches): a class from outside by
`module:Class` or `path/to/file.py:Class`, one by name through a Python entry-point group, and
its settings, a dataclass, from `key=value,...` text, each value typed by its field.

The registries themselves (`heal.method`, `select.search`) keep their own contract and built-ins;
this module holds the mechanics alone, with the option each error line names (`--method`,
`--search`), so that a user's plug-in is found, refused or configured the same way everywhere.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import keyword
import math
import sys
import typing
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

from depthcurse.errors import DepthcurseError


def load_outside(spec: str, base: type, option: str, what: str, public: str) -> type:
    """`module:Class` or `path/to/file.py:Class`: a user's class, loaded without editing ours, and
    checked to be a subclass of `base` (`what` it must be, and `public`, the name users import
    `base` by, for the error)."""
    where, _, attr = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser()
            if not path.is_file():
                raise DepthcurseError(f"{option} {spec}: no file {path}")
            name = f"depthcurse_outside_{path.stem}"
            module = sys.modules.get(name)
            if module is None or getattr(module, "__file__", None) != str(path.resolve()):
                loader_spec = importlib.util.spec_from_file_location(name, path.resolve())
                module = importlib.util.module_from_spec(loader_spec)
                sys.modules[name] = module
                loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except DepthcurseError:
        raise
    except Exception as exc:  # the user's module failed to import: say where, in one line
        raise DepthcurseError(f"{option} {spec}: importing {where} failed: {type(exc).__name__}: {exc}") from exc
    cls = getattr(module, attr, None)
    if cls is None:
        raise DepthcurseError(f"{option} {spec}: {where} has no class {attr}")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise DepthcurseError(f"{option} {spec}: {attr} in {where} is not {what}: make it a subclass of {public}")
    return cls


def entry_points_of(group: str) -> dict[str, object]:
    """The entry points a package installs in `group`, by name."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=group)}


def parse_args(text: str | None, option: str, example: str) -> dict[str, str]:
    """`key=value,key=value` (lm-eval's `--model_args`), kept as text until a field types it."""
    if not text or not text.strip():
        return {}
    out = {}
    for part in (p for p in text.split(",") if p.strip()):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise DepthcurseError(f"{option} {text!r}: give key=value pairs, e.g. {example}")
        scope, dot, bare = key.strip().rpartition(".")
        if keyword.iskeyword(bare):  # `as=code`: a setting a Python keyword names is its field with a trailing underscore (PEP 8's rule)
            bare += "_"
        if f"{scope}{dot}{bare}" in out:  # the last would win silently, after the work
            raise DepthcurseError(f"{option} {text!r}: {key.strip()} is given twice ({out[f'{scope}{dot}{bare}']} and {value.strip()}): give it once")
        out[f"{scope}{dot}{bare}"] = value.strip()
    return out


def changed_settings(settings) -> str:
    """A plug-in's settings away from their defaults, as `key=value,...` takes them (`as_` as `as`)."""
    defaults = type(settings)()
    return ",".join(f"{setting_name(f.name)}={getattr(settings, f.name)}" for f in fields(settings)
                    if getattr(settings, f.name) != getattr(defaults, f.name))


def setting_name(field_name: str) -> str:
    """How a user types the setting a field holds: `as_` is `as`."""
    return field_name[:-1] if field_name.endswith("_") and keyword.iskeyword(field_name[:-1]) else field_name


def typed(cls, name: str, value, owner: str, option: str):
    """`value` (text from the command line, or already typed) as the type of `cls`'s field `name`;
    one line naming `option` and the `owner`'s setting where the text is not of that type."""
    if not isinstance(value, str):
        return value
    kind = typing.get_type_hints(cls).get(name, str)
    args = typing.get_args(kind)
    if type(None) in args:  # `int | None`: "none" is None, else the other type
        if value.lower() in ("none", "null"):
            return None
        kind = next(a for a in args if a is not type(None))
    try:
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("true", "1", "yes")
        if kind is int:
            number = float(value)
            if not number.is_integer():
                raise ValueError(value)
            return int(number)
        if kind is float:
            number = float(value)
            if not math.isfinite(number):
                raise ValueError(value)
            return number
    except ValueError:
        raise DepthcurseError(f"{option} {name}={value}: {owner}'s {name} takes {getattr(kind, '__name__', kind)}") from None
    return value


def settings_fields(cls, option: str, args_option: str) -> tuple:
    """The fields of `cls.Settings`, which every contract asks to be a dataclass: one line naming
    the plug-in where it is not (Python's own error would name neither)."""
    if not (isinstance(cls.Settings, type) and is_dataclass(cls.Settings)):
        raise DepthcurseError(f"{option} {cls.name or cls.__name__}: its Settings must be a dataclass (the settings {args_option} sets), "
                              f"got {getattr(cls.Settings, '__name__', cls.Settings)!s}")
    return fields(cls.Settings)


def scoped(args: dict, spec: str, name: str, own: set[str], args_option: str) -> tuple[dict, set[str]]:
    """The settings in `args` meant for one plug-in: `key=value` where it has the key, and
    `scope.key=value` where the scope is its spec as typed or its name as the outputs print it (one
    line if it has no such key); and the argument keys used."""
    mine, used = {}, set()
    for key, value in args.items():
        scope, dot, bare = key.rpartition(".")
        if dot and scope in (spec, name):
            if bare not in own:
                raise DepthcurseError(f"{args_option} {key}: {name} has no setting {bare!r} (its settings: {', '.join(sorted(own)) or 'none'})")
            mine[bare] = value
            used.add(key)
        elif not dot and key in own:
            mine[key] = value
            used.add(key)
    return mine, used


def settings_listing(cls, prefix: str) -> list[dict]:
    """Every setting of a plug-in (`cls.Settings`): how it is typed (`prefix.key`), its type, its
    default, and the comment its dataclass gives it in the source (what it is, where its default
    comes from), read from the class's own source so that an outside plug-in is described as ours."""
    settings = getattr(cls, "Settings", None)
    if not (isinstance(settings, type) and is_dataclass(settings)):
        return []
    comments = {}
    try:
        for line in inspect.getsource(settings).splitlines():
            name, colon, rest = line.strip().partition(":")
            if colon and name.isidentifier() and "#" in rest:
                comments[name] = rest.split("#", 1)[1].strip()
    except (OSError, TypeError):  # defined where no source is kept (an interactive session)
        pass
    hints = typing.get_type_hints(settings)
    out = []
    for f in fields(settings):
        default = f.default if f.default is not MISSING else (f.default_factory() if f.default_factory is not MISSING else "(required)")
        kind = hints.get(f.name, f.type)
        out.append({"setting": f"{prefix}.{setting_name(f.name)}", "type": getattr(kind, "__name__", None) or str(kind).replace("typing.", ""),
                    "default": default, "about": comments.get(f.name, "")})
    return out
