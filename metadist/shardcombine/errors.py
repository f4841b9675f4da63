"""Errors of ShardCombine that reach the user.

The CLI prints every class in :data:`USER_ERRORS` as one clear line (exit status 2)
instead of a traceback, so each message says what failed, why, and how to fix it.
"""

from __future__ import annotations

__all__ = ["OracleError", "RuleDatabaseError", "RuleLookupError", "ShardCombineError", "USER_ERRORS"]


class ShardCombineError(RuntimeError):
    """Base class of ShardCombine's user-facing errors."""


class RuleDatabaseError(ShardCombineError):
    """The rule database cannot be opened, read, written or exported.

    Raised for a folder that cannot be created or written, a database that stays
    locked past the retry budget, or an export/import file that is not a MetaDist
    rule export. A corrupt database file is not an error: it is renamed aside and
    rebuilt, with a warning.
    """


class RuleLookupError(ShardCombineError):
    """The rule database has nothing for what was asked (an op it has never seen)."""


class OracleError(ShardCombineError):
    """The DTensor oracle cannot run (``torch.distributed`` or its fake process group is unavailable)."""


#: Errors the CLI reports as a one-line message with exit status 2.
USER_ERRORS: tuple[type[BaseException], ...] = (RuleDatabaseError, RuleLookupError, OracleError)
