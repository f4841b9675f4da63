"""Files written whole or not at all (metadist.files); pure Python."""

from __future__ import annotations

import os

import pytest

from metadist import files
from metadist.shardcombine.errors import RuleDatabaseError
from metadist.files import write_atomically
from metadist.shardcombine import sqlite_file


def test_a_file_is_written_whole_into_a_new_folder_and_replaced_whole(tmp_path):
    path = tmp_path / "new" / "plan.json"
    write_atomically(path, "first\n")
    assert path.read_text() == "first\n"
    write_atomically(path, "second\n", sync=False)
    assert path.read_text() == "second\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["plan.json"]  # no temporary file left


@pytest.mark.parametrize("where", ["write", "rename"])
def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path, monkeypatch, where):
    path = tmp_path / "calibration.json"
    path.write_text("old\n")
    if where == "rename":
        def fail(*args):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(files.os, "replace", fail)
        with pytest.raises(OSError, match="No space left"):
            write_atomically(path, "new\n")
    else:
        with pytest.raises(UnicodeEncodeError):  # text the file's encoding cannot hold, met halfway through
            write_atomically(path, "new\n" + "\udc80")
    assert path.read_text() == "old\n"
    assert sorted(os.listdir(tmp_path)) == ["calibration.json"]


def test_the_rule_database_says_which_path_it_could_not_write(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(RuleDatabaseError, match="cannot write .*export.json.*choose a writable location"):
        sqlite_file.write_atomically(blocker / "export.json", "{}")  # its folder would be inside a file
