"""Imported by the fork server of ``metadist run``'s ranks (:func:`metadist.forking.start_fork_server`) before the
rank's entry point: it imports :data:`metadist.forking.FORK_PRELOAD` with the garbage collector paused, then collects
once and freezes what the imports left out of the collector's sight (:func:`metadist.gc_pause.freeze_survivors`).

Importing torch and MetaDist with the collector on, the server traversed their objects again and again as they came
(four full collections, ~0.3 s, while the ranks waited for it). A rank forked from the server then never traverses
them in its own full collections, which also leave the pages it shares with the server unwritten (as Python's
``gc.freeze`` documentation advises before a fork). Importing this module has that one effect; nothing else imports
it.
"""

from __future__ import annotations

import importlib

from .forking import FORK_PRELOAD
from .gc_pause import freeze_survivors, gc_paused

with gc_paused():
    for _name in FORK_PRELOAD:
        importlib.import_module(_name)

FROZEN = freeze_survivors()
"""How many objects the import froze (0 where the collector was off)."""
