"""The searches that come with depthcurse, one module each; each registers itself by defining its
`Search` subclass (`select.search`). A new built-in search is a new file in this folder and nothing
else; a search of one's own is a module like these, outside."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
