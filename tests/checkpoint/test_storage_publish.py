"""trainloop.checkpoint.storage: a reader sees the old directory or the complete new one, and what
a crash leaves is settled by ``clean_leftovers``."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from trainloop.checkpoint.storage import (
    clean_leftovers,
    discard,
    drop_replaced,
    make_temporary,
    publish,
    remove_directory,
    replace_symlink,
    unpublish,
)

LOGGER = logging.getLogger("test_atomic")


def entries(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def fill(directory: Path, text: str) -> None:
    (directory / "a.txt").write_text(text)
    (directory / "sub").mkdir()
    (directory / "sub" / "b.txt").write_text(text * 2)


def write_directory(target: Path, text: str) -> None:
    """Fill a temporary directory and publish it as ``target``, as a save does."""
    tmp = make_temporary(target)
    fill(tmp, text)
    drop_replaced(publish(tmp, target))


def test_publish_renames_a_complete_directory_into_place_and_leaves_nothing_hidden(tmp_path):
    target = tmp_path / "deep" / "7"
    tmp = make_temporary(target)
    assert tmp.parent == target.parent
    assert tmp.name.startswith(".7.tmp-")
    fill(tmp, "x")
    assert not target.exists()  # invisible under its name until complete
    assert publish(tmp, target) is None  # nothing replaced
    assert (target / "sub" / "b.txt").read_text() == "xx"
    assert entries(target.parent) == ["7"]


def test_replacing_keeps_the_old_contents_until_the_new_are_complete(tmp_path):
    target = tmp_path / "7"
    write_directory(target, "old")
    tmp = make_temporary(target)
    fill(tmp, "new")
    discard(tmp)  # cut short
    assert (target / "a.txt").read_text() == "old"
    assert entries(tmp_path) == ["7"]
    tmp = make_temporary(target)
    fill(tmp, "new")
    replaced = publish(tmp, target)
    assert replaced is not None
    assert replaced.name.startswith(".7.old-")  # moved aside until dropped
    assert (target / "a.txt").read_text() == "new"
    drop_replaced(replaced)
    assert entries(tmp_path) == ["7"]


def test_unpublish_takes_the_new_directory_out_and_restores_the_replaced_one(tmp_path):
    target = tmp_path / "7"
    write_directory(target, "old")
    tmp = make_temporary(target)
    fill(tmp, "new")
    replaced = publish(tmp, target)
    assert (target / "a.txt").read_text() == "new"
    unpublish(target, replaced)  # a step the publication needs (latest) failed
    assert (target / "a.txt").read_text() == "old"
    assert entries(tmp_path) == ["7"]


def test_unpublishing_a_first_publication_leaves_no_directory(tmp_path):
    target = tmp_path / "7"
    tmp = make_temporary(target)
    fill(tmp, "new")
    unpublish(target, publish(tmp, target))
    assert entries(tmp_path) == []


def test_discard_and_remove_directory(tmp_path):
    tmp = make_temporary(tmp_path / "3")
    fill(tmp, "x")
    discard(tmp)
    discard(tmp)  # already gone: nothing to do
    assert entries(tmp_path) == []
    (tmp_path / "4").mkdir()
    fill(tmp_path / "4", "y")
    remove_directory(tmp_path / "4")
    assert entries(tmp_path) == []


def test_replace_symlink_is_relative_and_replaces(tmp_path):
    (tmp_path / "1").mkdir()
    (tmp_path / "2").mkdir()
    replace_symlink(tmp_path / "latest", "1")
    replace_symlink(tmp_path / "latest", "2")
    assert os.readlink(tmp_path / "latest") == "2"
    assert (tmp_path / "latest").resolve() == (tmp_path / "2").resolve()
    assert entries(tmp_path) == ["1", "2", "latest"]


def test_clean_leftovers_restores_a_moved_aside_directory_and_removes_the_rest(tmp_path, caplog):
    for name in ("5", ".5.tmp-0a", ".6.old-0b", ".4.del-0c", ".7.old-0d"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text(name)
    os.symlink("5", tmp_path / ".latest.tmp-0e")
    (tmp_path / "7").mkdir()  # the new 7 made it: its old copy goes
    (tmp_path / ".hidden-by-user").mkdir()  # not ours: untouched
    with caplog.at_level(logging.WARNING, logger="test_atomic"):
        clean_leftovers(tmp_path, LOGGER)
    assert entries(tmp_path) == [".hidden-by-user", "5", "6", "7"]
    assert (tmp_path / "6" / "f").read_text() == ".6.old-0b"
    assert "Restored" in caplog.text
    assert str(tmp_path / "6") in caplog.text
    clean_leftovers(tmp_path / "absent", LOGGER)  # no directory: nothing to do


def test_atomic_file_replaces_the_target_whole_or_not_at_all(tmp_path):
    from trainloop.checkpoint.storage import atomic_file

    target = tmp_path / "sub" / "out.bin"
    with atomic_file(target) as tmp:
        tmp.write_bytes(b"first")
        assert not target.exists()  # nothing under the name until the write is complete
    assert target.read_bytes() == b"first"
    def write_half_then_fail():
        with atomic_file(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("the writer failed")

    with pytest.raises(RuntimeError, match="the writer failed"):
        write_half_then_fail()
    assert target.read_bytes() == b"first"  # the old file, untouched
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.bin"]  # no temporary file left


def test_atomic_file_gives_the_file_the_mode_a_new_file_gets_not_the_writers_private_one(tmp_path):
    import os
    import stat

    import torch
    from safetensors.torch import save_file

    from trainloop.checkpoint.storage import atomic_file

    mask = os.umask(0o022)  # a usual umask, for a known expectation
    try:
        target = tmp_path / "predictions.safetensors"
        with atomic_file(target) as tmp:
            save_file({"x": torch.zeros(2)}, str(tmp))
            os.chmod(tmp, 0o600)  # as a writer through a private temporary file leaves it
        assert stat.S_IMODE(target.stat().st_mode) == 0o644
    finally:
        os.umask(mask)
