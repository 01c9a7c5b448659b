"""Recipes run from any folder: absolute config paths, bundled assets found through the package,
relative output_dir under the cwd, CPU threads capped by default, configs and recipes copied out.
Every shipped config, and every YAML example of the docs, names its files by absolute path or
through ``${logitless_asset:...}``, never relative to the repo."""

import os
import pathlib
import re
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from logitless.resources import PACKAGE_DIR
from logitless.training import complete_checkpoints

REPO = pathlib.Path(__file__).resolve().parents[2]
TORCHAO_MESSAGE = "Skipping import of cpp extensions"
# the user's environment, not the test runner's: no thread count forced on torch
NO_THREAD_ENV = {"OMP_NUM_THREADS": None, "MKL_NUM_THREADS": None}


# Keys whose values are files or folders. checkpoint_files are names inside checkpoint_dir.
PATH_KEY = re.compile(r"(^|_)(dir|path|file|files)$")
NOT_PATHS = ("checkpoint_files",)
# output_dir is the cwd's when relative, as in torchtune (and so is what derives from it)
CWD_RELATIVE = ("output_dir",)


def path_values(node, key=""):
    """(dotted key, value) of every string under a file-or-folder key of a config tree (lists too)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from path_values(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list):
        for v in node:
            yield from path_values(v, key)
    elif isinstance(node, str):
        name = key.rsplit(".", 1)[-1]
        if PATH_KEY.search(name) and name not in NOT_PATHS:
            yield key, node


def repo_relative_paths(raw):
    """Path values of an unresolved config tree that would be read relative to the cwd (an
    interpolation is checked where its value is written, or is a bundled asset)."""
    return [(k, v) for k, v in path_values(raw)
            if k.rsplit(".", 1)[-1] not in CWD_RELATIVE and not v.startswith("${") and not os.path.isabs(v)]


@pytest.mark.parametrize("path", sorted(REPO.glob("configs/*.yaml")), ids=lambda p: p.stem)
def test_every_config_resolves_its_paths_from_another_folder(tmp_path, monkeypatch, path):
    """Every interpolation resolves from an unrelated cwd, no file is named relative to the repo,
    and every file the config names inside the package exists."""
    monkeypatch.chdir(tmp_path)
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    assert repo_relative_paths(raw) == []
    resolved = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    bundled = [(k, v) for k, v in path_values(resolved) if v.startswith(str(PACKAGE_DIR))]
    assert all(os.path.exists(v) for _, v in bundled), bundled


def yaml_examples():
    """Every ```yaml block of README.md and docs/*.md, as a parameter named FILE:LINE."""
    for doc in [REPO / "README.md", *sorted(REPO.glob("docs/*.md"))]:
        for m in re.finditer(r"^```yaml\n(.*?)^```", doc.read_text(), re.S | re.M):
            line = doc.read_text()[:m.start()].count("\n") + 1
            yield pytest.param(m.group(1), id=f"{doc.name}:{line}")


@pytest.mark.parametrize("block", list(yaml_examples()))
def test_yaml_examples_name_no_file_relative_to_the_repo(block):
    raw = OmegaConf.to_container(OmegaConf.create(block), resolve=False)
    assert repo_relative_paths(raw) == []


def expected_auto_threads(local_world_size: int = 1) -> int:
    """cpu_threads=auto on a CPU device: the cores this process may use, per local process, less one
    left to the data loader and to whatever else runs (docs/sft_recipes.md)."""
    return max(1, len(os.sched_getaffinity(0)) // local_world_size - 1)


def reported_threads(log: str) -> int:
    m = re.search(r"torch uses (\d+) CPU threads", log)
    assert m, log[-3000:]
    return int(m.group(1))


@pytest.mark.slow
def test_tiny_sft_from_another_folder(tune_cli, tmp_path):
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    p = tune_cli(["run", "full_sft_single_device", "--config", str(REPO / "configs/tiny_full.yaml"),
                  "max_steps=2", "batch_size=4", "gradient_accumulation_steps=1", "save_every_n_steps=null"],
                 "runs/sft", env=NO_THREAD_ENV, cwd=cwd)
    log = p.communicate(timeout=600)[0]
    assert p.returncode == 0, log[-3000:]
    # a relative output_dir is the cwd's, as in torchtune
    assert [c.name for c in complete_checkpoints(cwd / "runs/sft")] == ["step_000002"]
    assert reported_threads(log) == expected_auto_threads()


@pytest.mark.slow
@pytest.mark.parametrize("config", ["tiny_grpo", "tiny_grpo_chat"])
def test_tiny_grpo_from_another_folder(tune_cli, tmp_path, config):
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    p = tune_cli(["run", "grpo_single_device", "--config", str(REPO / f"configs/{config}.yaml"),
                  "max_steps=1", "prompts_per_step=4", "num_generations=4", "micro_batch_size=8",
                  "generation.max_new_tokens=3", "eval_every_n_steps=null", "cpu_threads=auto"],
                 tmp_path / "grpo", env=NO_THREAD_ENV, cwd=cwd)
    log = p.communicate(timeout=600)[0]
    assert p.returncode == 0, log[-3000:]
    assert [c.name for c in complete_checkpoints(tmp_path / "grpo")] == ["step_000001"]
    assert reported_threads(log) == expected_auto_threads()


@pytest.mark.slow
def test_copied_recipe_runs_with_a_config_name_and_no_torchao_message(tmp_path):
    """``logitless cp`` a recipe, then ``logitless run ./copy.py --config tiny_lora`` from that folder."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "components"), str(REPO / "recipes"),
                                                       os.environ.get("PYTHONPATH", "")]))

    def logitless(*args):
        return subprocess.run([sys.executable, "-m", "logitless", *args], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)

    cp = logitless("cp", "lora_sft_single_device", "my_lora.py")
    assert cp.returncode == 0, cp.stdout
    assert (tmp_path / "my_lora.py").read_bytes() == (REPO / "recipes/lora_sft_single_device.py").read_bytes()
    run = logitless("run", "./my_lora.py", "--config", "tiny_lora", "output_dir=out", "max_steps=1",
                    "batch_size=2", "gradient_accumulation_steps=1", "save_every_n_steps=null")
    assert run.returncode == 0, run.stdout[-3000:]
    assert [c.name for c in complete_checkpoints(tmp_path / "out")] == ["step_000001"]
    assert TORCHAO_MESSAGE not in run.stdout
