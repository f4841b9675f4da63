"""Writing a file whole or not at all: the one helper every MetaDist module writes its text files with.

A plan, a graph, a calibration, the rule database's export, a rank's phase: each is written to a temporary file
in the target's folder and renamed over the target, so a reader sees the old file or the new one, never part of
one. Errors are raised as they come (``OSError``); callers that own an error type (the rule database) wrap them.
Pure Python, no torch.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_atomically"]


def write_atomically(path: str | os.PathLike, text: str, *, sync: bool = True) -> None:
    """Write ``text`` to ``path`` through a temporary file in its folder (made if missing) and a rename.

    ``sync``: flush the temporary file to disk before the rename, so that a machine that stops right after holds the
    old file or the whole new one. False for files rewritten many times a second whose loss costs nothing (a rank's
    phase name). The temporary file is removed when anything fails, the rename included.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            if sync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
