"""What a first start compiles is said before it happens; inductor's cache is kept under the user's cache folder."""

import logging
import os
import pathlib

import pytest

from logitless import first_start
from logitless.first_start import (INDUCTOR_CACHE_ENV, default_compile_cache_dir, note_compile,
                                   use_persistent_compile_cache)


def test_the_cache_folder_is_per_user_and_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_compile_cache_dir() == tmp_path / "home" / ".cache" / "logitless" / "torchinductor"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_compile_cache_dir() == tmp_path / "xdg" / "logitless" / "torchinductor"


def test_a_set_cache_variable_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    assert use_persistent_compile_cache() == tmp_path / "xdg" / "logitless" / "torchinductor"
    assert os.environ[INDUCTOR_CACHE_ENV] == str(tmp_path / "xdg" / "logitless" / "torchinductor")
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, str(tmp_path / "mine"))
    assert use_persistent_compile_cache() == tmp_path / "mine"
    assert os.environ[INDUCTOR_CACHE_ENV] == str(tmp_path / "mine")


def test_inductor_uses_the_folder_set_before_its_first_compile(monkeypatch, tmp_path):
    """The variable is what inductor's own cache look-up reads (torch's cache_dir())."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    use_persistent_compile_cache()
    assert pathlib.Path(cache_dir()) == tmp_path / "logitless" / "torchinductor"


def test_each_compilation_is_announced_once_per_process(monkeypatch, caplog):
    monkeypatch.setattr(first_start, "_NOTED", set())
    with caplog.at_level(logging.INFO, logger="logitless"):
        assert note_compile("the thing") is True
        assert note_compile("the thing") is False
        assert note_compile("another thing") is True
    assert [r.getMessage().split(": once per process")[0] for r in caplog.records if r.name == "logitless"] == [
        "Compiling the thing", "Compiling another thing"]
    assert "once per process" in caplog.records[0].getMessage()


def test_compile_true_announces_the_layers(monkeypatch, caplog):
    from logitless.models import qwen2_5_tiny
    from logitless.training.model import compile_layers

    monkeypatch.setattr(first_start, "_NOTED", set())
    with caplog.at_level(logging.INFO, logger="logitless"):
        compile_layers(qwen2_5_tiny())
    assert [r.getMessage().split(": once per process")[0] for r in caplog.records if r.name == "logitless"] == [
        "Compiling each transformer layer (compile: True), at the first forward"]
