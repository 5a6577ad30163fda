"""The searches that come with depthcurse, one module each; each registers itself by defining its
`Search` subclass (`select.search`). A search of one's own is a module like these, outside."""

from depthcurse.select.searches import angular, bi, evo, exact, greedy, last, one_shot, random_sets  # noqa: F401
