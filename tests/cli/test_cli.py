"""``logitless ls`` / ``logitless cp`` / ``logitless run``'s name resolution, against the files in the repo."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from logitless import cli

REPO = pathlib.Path(__file__).resolve().parents[2]
RECIPE_FILES = sorted(REPO.glob("recipes/*.py"))
CONFIG_FILES = sorted(REPO.glob("configs/*.yaml"))


def ls_rows(capsys):
    """(recipe, config) pairs of the ``logitless ls`` table (a blank recipe column repeats the last one)."""
    assert cli.main(["ls"]) == 0
    table = capsys.readouterr().out.split("\n\n")[0].splitlines()
    assert table[0].split() == ["RECIPE", "CONFIG"]
    rows, recipe = [], None
    for line in table[1:]:
        cols = line.split()
        if not line.startswith(" "):
            recipe = cols.pop(0)
        rows.append((recipe, cols[0]))
    return rows


def test_ls_lists_every_recipe_and_config_file(capsys):
    rows = ls_rows(capsys)
    assert {r for r, _ in rows} == {f.stem for f in RECIPE_FILES}
    assert {c for _, c in rows} == {f.stem for f in CONFIG_FILES}


def test_ls_pairs_match_the_commands_in_each_config_header(capsys):
    """Every ``tune run [...] RECIPE --config configs/NAME.yaml`` a config documents is listed by ls."""
    rows = set(ls_rows(capsys))
    for f in CONFIG_FILES:
        for recipe, name in re.findall(r"tune run (?:--nproc_per_node \d+ )?(\w+) --config configs/(\w+)\.yaml",
                                       f.read_text()):
            assert (recipe, name) in rows, (recipe, name)


@pytest.mark.parametrize("name,source", [("tiny_grpo", "configs/tiny_grpo.yaml"),
                                         ("full_sft_distributed", "recipes/full_sft_distributed.py")])
def test_cp_copies_identical_bytes_and_refuses_to_overwrite(tmp_path, capsys, name, source):
    dest = tmp_path / "mine" / pathlib.Path(source).name
    dest.parent.mkdir()
    assert cli.main(["cp", name, str(dest)]) == 0
    assert dest.read_bytes() == (REPO / source).read_bytes()
    assert "tune run" in capsys.readouterr().out  # tells how to run the copy
    dest.write_text("my edits\n")
    with pytest.raises(SystemExit) as e:
        cli.main(["cp", name, str(dest)])
    assert e.value.code != 0 and str(dest) in capsys.readouterr().err
    assert dest.read_text() == "my edits\n"
    assert cli.main(["cp", "--force", name, str(dest)]) == 0
    assert dest.read_bytes() == (REPO / source).read_bytes()


def test_cp_into_a_folder_keeps_the_file_name_and_adds_a_missing_suffix(tmp_path):
    assert cli.main(["cp", "tiny_full", str(tmp_path)]) == 0
    assert (tmp_path / "tiny_full.yaml").read_bytes() == (REPO / "configs/tiny_full.yaml").read_bytes()
    assert cli.main(["cp", "grpo_single_device", str(tmp_path / "my_grpo")]) == 0
    assert (tmp_path / "my_grpo.py").read_bytes() == (REPO / "recipes/grpo_single_device.py").read_bytes()


def test_cp_of_an_entry_point_names_the_recipe_that_holds_its_loop(tmp_path, capsys):
    """Every recipe either holds a loop (a class with setup/train/cleanup) or imports the one the
    registry names, and copying it says where that loop is."""
    from logitless.recipe_registry import RECIPES

    for recipe in RECIPES:
        source = (REPO / "recipes" / f"{recipe.name}.py").read_text()
        if recipe.loop is None:
            assert all(f"    def {m}(self)" in source for m in ("setup", "train", "cleanup")), recipe.name
            continue
        assert f"from {recipe.loop} import " in source and "class " not in source, recipe.name
        assert cli.main(["cp", recipe.name, str(tmp_path / f"my_{recipe.name}.py")]) == 0
        assert f"logitless cp {recipe.loop} DEST" in capsys.readouterr().out


def test_cp_unknown_name_is_an_error_naming_it(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["cp", "tiny_nothing", str(tmp_path / "x.yaml")])
    err = capsys.readouterr().err
    assert e.value.code != 0 and "tiny_nothing" in err and "logitless ls" in err
    assert not (tmp_path / "x.yaml").exists()


def test_run_resolves_config_names_and_recipe_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "elsewhere")
    (tmp_path / "my_recipe.py").write_text("")
    (tmp_path / "tiny_full.yaml").write_text("")  # an existing file wins over a bundled name
    argv = cli.tune_run_argv(["--nproc_per_node", "2", "./my_recipe.py", "--config", "tiny_grpo", "seed=1"])
    assert argv == ["run", "--nproc_per_node", "2", "my_recipe", "--config",
                    str(REPO / "components/logitless/configs/tiny_grpo.yaml"), "seed=1"]
    assert sys.path[0] == str(tmp_path) and os.environ["PYTHONPATH"] == f"{tmp_path}{os.pathsep}elsewhere"
    assert cli.tune_run_argv(["grpo_single_device", "--config", "tiny_full.yaml"])[-1] == "tiny_full.yaml"
    # overrides may come before --config; a torchrun option's value is not the recipe
    assert cli.tune_run_argv(["--nnodes", "1", "grpo_single_device", "seed=2", "--config", "qwen_grpo"]) == [
        "run", "--nnodes", "1", "grpo_single_device", "seed=2", "--config",
        str(REPO / "components/logitless/configs/qwen_grpo.yaml")]


def test_importing_a_recipe_prints_no_torchao_message():
    """A distributed worker runs ``python -m RECIPE``: nothing may be printed about torchao's C++ extensions."""
    res = subprocess.run([sys.executable, str(REPO / "recipes/grpo_distributed.py"), "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=300,
                         env={"PATH": "", "PYTHONPATH": f"{REPO / 'components'}"})
    assert res.returncode == 0, res.stderr
    assert "Skipping import of cpp extensions" not in res.stdout + res.stderr


def imported_modules(args, cwd):
    """Names of every module ``python -m logitless ARGS`` imports (``python -X importtime`` lists each
    on stderr as ``import time: self | cumulative | name``), and the finished process."""
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "logitless", *args], cwd=cwd,
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "components"),
                                                                          str(REPO / "recipes")])))
    names = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    return names, res


@pytest.mark.parametrize("args", [["--help"], ["ls"], ["cp", "tiny_grpo", "copy.yaml"]], ids=["help", "ls", "cp"])
def test_the_command_answers_without_importing_torch(tmp_path, args):
    """Listing and copying need no torch: importing it takes seconds (tens under load)."""
    names, res = imported_modules(args, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "logitless.cli" in names  # the list holds the command's own imports
    assert sorted(n for n in names if n.split(".")[0] in ("torch", "torchtune", "triton")) == []
    if args[0] == "ls":
        assert "tiny_grpo_chat" in res.stdout
