"""The old name of ``loomax.hooks`` (the built-in hooks), kept so that old imports work:
``loomax.callbacks`` and every ``loomax.callbacks.<module>`` are the modules of ``loomax.hooks``."""

import sys

from loomax.hooks import *  # noqa: F403
from loomax.hooks import __all__  # noqa: F401

for _name, _module in list(sys.modules.items()):
    if _name.startswith("loomax.hooks."):
        sys.modules["loomax.callbacks." + _name.removeprefix("loomax.hooks.")] = _module
