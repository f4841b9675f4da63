"""Imported last by the fork server of ``metadist run``'s ranks (:func:`metadist.forking.start_fork_server`): its
imports, done, are frozen out of the garbage collector's sight (:func:`metadist.gc_pause.freeze_survivors`).

A rank forked from the server then never traverses the objects of torch and MetaDist in its full collections, and
its collections do not write to the pages it shares with the server (as Python's ``gc.freeze`` documentation
advises before a fork). Importing this module has that one effect; nothing else imports it.
"""

from __future__ import annotations

from .gc_pause import freeze_survivors

FROZEN = freeze_survivors()
"""How many objects the import froze (0 where the collector was off)."""
