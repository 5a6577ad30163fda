"""Every plug-in's settings, from the registries of searches and recovery methods, for `depthcurse
settings`: the built-in ones, installed entry points, and any `module:Class` or `file.py:Class`."""

from __future__ import annotations

from depthcurse.errors import DepthcurseError
from depthcurse.heal.method import Method, find_method, method_names
from depthcurse.plugins import load_outside, settings_listing
from depthcurse.select.search import Search, find_search, search_names


def _classes(names: list[str]) -> list[tuple[str, type]]:
    """(what it is, class) for each name, or for every search and method where none is given."""
    if not names:
        return [("search", find_search(n)) for n in search_names()] + [("method", find_method(n)) for n in method_names()]
    out = []
    for name in names:
        if ":" in name:  # outside: a search or a method, whichever it subclasses
            cls = load_outside(name, (Search, Method), "settings", "a search or a recovery method",
                               "depthcurse.select.Search or depthcurse.heal.Method")
            out.append(("search" if issubclass(cls, Search) else "method", cls))
            continue
        found = []
        for kind, find, known in (("search", find_search, search_names), ("method", find_method, method_names)):
            if name in known():
                found.append((kind, find(name)))
        if not found:
            raise DepthcurseError(f"settings {name}: no search or method of that name (searches: {', '.join(search_names())}; "
                                  f"methods: {', '.join(method_names())}; or module:Class / file.py:Class)")
        out += found
    return out


def settings_rows(names: list[str]) -> list[dict]:
    """A row naming each plug-in and where it comes from, then a row per setting."""
    rows = []
    for kind, cls in _classes(names):
        listed = settings_listing(cls, cls.name)
        rows.append({"for": f"{kind} {cls.name}", "setting": "" if listed else "(no settings)", "type": "", "default": "",
                     "about": getattr(cls, "source", "") or ""})
        if kind == "method":  # heal takes a method's setting as key=value alone, or name.key=value among several methods: both forms
            listed = [{**row, "setting": f"{row['setting'].split('.', 1)[-1]} | {row['setting']}"} for row in listed]
        rows += [{"for": "", **row} for row in listed]
    return rows
