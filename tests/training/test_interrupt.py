"""Ctrl-C in a recipe: one line naming the newest complete checkpoint, exit status 130."""

import pytest

from logitless.training.checkpoint import MARKER
from logitless.training.interrupt import INTERRUPTED_EXIT_CODE, exit_on_interrupt, interrupted_message


def make_step(out, step, complete=True):
    folder = out / f"step_{step:06d}"
    folder.mkdir(parents=True)
    if complete:
        (folder / MARKER).write_text("{}")
    return folder


def test_the_line_names_the_newest_complete_checkpoint(tmp_path):
    make_step(tmp_path, 10)
    newest = make_step(tmp_path, 30)
    make_step(tmp_path, 40, complete=False)  # a save cut short: no marker
    assert interrupted_message(tmp_path, 37) == (
        f"Interrupted after step 37; last checkpoint: {newest} (resume with resume_from_checkpoint=auto)")
    assert interrupted_message(tmp_path, None).startswith("Interrupted before training started; last checkpoint: ")


def test_without_a_checkpoint_the_line_says_so(tmp_path):
    msg = interrupted_message(tmp_path / "absent", 3)
    assert msg.startswith("Interrupted after step 3; no checkpoint saved in ") and "from step 0" in msg


def test_keyboard_interrupt_becomes_the_line_and_status_130(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LOGITLESS_DEBUG", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    make_step(tmp_path, 2)
    progress = {"step": 2}
    with pytest.raises(SystemExit) as e:
        with exit_on_interrupt(tmp_path, lambda: progress["step"]):
            progress["step"] = 3
            raise KeyboardInterrupt
    assert e.value.code == INTERRUPTED_EXIT_CODE == 130
    assert capsys.readouterr().err == interrupted_message(tmp_path, 3) + "\n"
    with exit_on_interrupt(tmp_path, lambda: 0):  # nothing happens without an interrupt
        pass


def test_other_ranks_stay_silent_and_debug_keeps_the_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        with exit_on_interrupt(tmp_path, lambda: 1):
            raise KeyboardInterrupt
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("LOGITLESS_DEBUG", "1")
    with pytest.raises(KeyboardInterrupt):
        with exit_on_interrupt(tmp_path, lambda: 1):
            raise KeyboardInterrupt
