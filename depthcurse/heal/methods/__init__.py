"""The recovery methods that come with depthcurse, one module each; defining a `Method` subclass
here registers it by its name (`heal.method.BUILTIN`). A new built-in method is a new file in this
folder and nothing else; a user's own plugs in from outside (`heal.method.find_method`)."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
