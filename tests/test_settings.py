"""logitless.settings: every LOGITLESS_* knob read through one object, documented in docs/CONTRACT.md."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from logitless.settings import KNOBS, describe, settings

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_env_override_and_bad_values(monkeypatch):
    for name, knob in KNOBS.items():
        monkeypatch.delenv(knob.env, raising=False)
        assert getattr(settings, name) == knob.default
    monkeypatch.setenv("LOGITLESS_TRITON_WORKSPACE_MB", "64")
    monkeypatch.setenv("LOGITLESS_TRITON_COMPACT", "0")
    assert settings.triton_workspace_mb == 64 and settings.triton_compact is False
    with settings.override(triton_compact=True):
        assert settings.triton_compact is True
    assert settings.triton_compact is False
    monkeypatch.setenv("LOGITLESS_TRITON_WORKSPACE_MB", "lots")
    with pytest.raises(ValueError, match=r"LOGITLESS_TRITON_WORKSPACE_MB='lots': expected a positive integer"):
        settings.triton_workspace_mb
    monkeypatch.setenv("LOGITLESS_TRITON_COMPACT", "maybe")
    with pytest.raises(ValueError, match=r"LOGITLESS_TRITON_COMPACT='maybe': expected one of"):
        settings.triton_compact
    with pytest.raises(AttributeError, match="no knob 'triton_workspace'"):
        settings.triton_workspace
    with pytest.raises(AttributeError, match="no knob"):
        with settings.override(nope=1):
            pass


def test_every_env_knob_in_the_code_is_a_setting_and_documented():
    # Any LOGITLESS_* name the package reads must be declared in settings.KNOBS, and docs/CONTRACT.md
    # must carry the generated table (so defaults in the docs cannot drift from the code).
    used = set()
    for path in (ROOT / "components" / "logitless").rglob("*.py"):
        used |= set(re.findall(r"LOGITLESS_[A-Z_]+[A-Z]", path.read_text()))
    declared = {k.env for k in KNOBS.values()}
    assert used <= declared, f"read but not declared in logitless.settings: {sorted(used - declared)}"
    contract = (ROOT / "docs" / "CONTRACT.md").read_text()
    for line in describe()[2:]:
        assert line in contract, f"docs/CONTRACT.md lacks the settings row: {line}"


def test_head_workspace_is_sized_from_the_environment_at_import():
    code = "from logitless.ops.triton import head; print(head.WORKSPACE_BYTES, head.FUSED_MAX_CHUNKS)"
    env = {"LOGITLESS_TRITON_WORKSPACE_MB": "32", "LOGITLESS_TRITON_FUSED_MAX_CHUNKS": "3",
           "PYTHONPATH": str(ROOT / "components")}
    import os

    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == [str(32 << 20), "3"]
