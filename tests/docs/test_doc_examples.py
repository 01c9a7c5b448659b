"""Every ```python block of README.md and docs/*.md runs as written, unless it is marked a fragment.

The convention: a block that is not meant to run as it stands (a signature listing, a protocol
sketch, code that needs a GPU, vLLM or a downloaded model) has the HTML comment

    <!-- fragment -->            or        <!-- fragment: why it does not run -->

on the line right before its opening fence. GitHub does not render the comment. Every other block
runs: the blocks of one file run in order in one fresh Python process, sharing one namespace (a
later block may use what an earlier one defined, as a reader of the page would), on the CPU, with a
time limit, from a scratch folder. There ``outputs/NAME`` holds the output of the tiny run ``NAME``
(the bundled ``configs/NAME.yaml``, see :data:`TINY_RUNS`) when a block of the file names it; each
such run is made once per test session. A failing block is reported with its file and line.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List

import pytest
from omegaconf import OmegaConf

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted(REPO.glob("docs/*.md"))]
FRAGMENT = re.compile(r"^<!-- fragment(: [^>]*)? -->$")
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
OUTPUT = re.compile(r"\boutputs/(\w+)")
TIMEOUT_S = 900

# How each tiny run a doc example reads is made: its config, the recipe, and overrides that keep the
# folders the documented command writes (the final step's number) at a fraction of its cost.
TINY_RUNS = {
    # batch 1 instead of 8 x 2: the same 125 steps (max_steps) and final checkpoint step_000125
    "tiny_lora": dict(recipe="sft", lora=True, overrides={"batch_size": 1, "gradient_accumulation_steps": 1,
                                                          "save_every_n_steps": None}),
    # one small step, logging its completions
    "tiny_grpo_chat": dict(recipe="grpo", overrides={"max_steps": 1, "prompts_per_step": 4, "num_generations": 4,
                                                     "micro_batch_size": 16, "eval_every_n_steps": None,
                                                     "log_completions_every_n_steps": 1}),
}


@dataclass
class Block:
    doc: pathlib.Path
    line: int  # of the opening fence, 1-based
    code: str
    fragment: bool

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"


def python_blocks(doc: pathlib.Path) -> List[Block]:
    """The ```python blocks of a Markdown file, each marked fragment or not."""
    text = doc.read_text()
    blocks = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        blocks.append(Block(doc, line, m.group(1), fragment=bool(FRAGMENT.match(before.strip()))))
    return blocks


def test_every_fragment_marker_sits_on_a_python_block():
    """A marker anywhere else (a moved block, a typo) would silently stop marking anything."""
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        for i, line in enumerate(lines):
            if "<!-- fragment" in line:
                assert FRAGMENT.match(line.strip()), f"{doc.name}:{i + 1}: expected '<!-- fragment -->' or " \
                                                     f"'<!-- fragment: why -->', got {line!r}"
                assert i + 1 < len(lines) and lines[i + 1].startswith("```python"), \
                    f"{doc.name}:{i + 1}: a fragment marker must be the line right before a ```python fence"


def planned_checkpoints(name: str) -> List[int]:
    """Steps whose checkpoints ``tune run ... --config configs/NAME.yaml`` writes (an SFT tiny config):
    every ``save_every_n_steps`` and the last step, min(max_steps, epochs x steps per epoch), where an
    epoch is the bundled training rows (none is dropped at the tiny ``max_seq_len``) in batches of
    ``batch_size x gradient_accumulation_steps``."""
    cfg = OmegaConf.load(REPO / "configs" / f"{name}.yaml")
    from logitless.datasets import TINY_ALPACA_FILES

    rows = len(json.loads(pathlib.Path(TINY_ALPACA_FILES["train"]).read_text()))
    last = min(cfg.max_steps, cfg.epochs * (rows // (cfg.batch_size * cfg.gradient_accumulation_steps)))
    every = cfg.save_every_n_steps or last
    return sorted(set(range(every, last + 1, every)) | {last})


def test_the_docs_name_checkpoints_the_tiny_sft_runs_write():
    """``outputs/tiny_full/step_NNNNNN`` in the docs names a step the run reaches (an example may save
    more often than the config does), and ``Final model (step N)`` its last step."""
    paths, finals = [], []
    for doc in DOCS:
        text = doc.read_text()
        paths += [(doc.name, run, int(step)) for run, step in re.findall(r"outputs/(tiny_full|tiny_lora)/step_(\d{6})", text)]
        finals += [(doc.name, run, int(step)) for step, run in
                   re.findall(r"Final model \(step (\d+)\): outputs/(tiny_full|tiny_lora)/", text)]
    assert paths and finals  # the docs do name some
    last = {run: planned_checkpoints(run)[-1] for run in ("tiny_full", "tiny_lora")}
    assert [p for p in paths if p[2] > last[p[1]]] == [], last
    assert [f for f in finals if f[2] != last[f[1]]] == [], last


def make_tiny_run(name: str, out: pathlib.Path) -> None:
    """Runs the tiny config ``name`` with its :data:`TINY_RUNS` overrides into ``out``; an SFT run
    must end at the step the documented command ends at."""
    spec = TINY_RUNS[name]
    cfg = OmegaConf.load(REPO / "configs" / f"{name}.yaml")
    cfg.output_dir = str(out)
    for key, value in spec["overrides"].items():
        OmegaConf.update(cfg, key, value, merge=False)
    if spec["recipe"] == "sft":
        from full_sft_single_device import SFTRecipe
        from logitless.training import complete_checkpoints

        SFTRecipe(cfg, lora=spec.get("lora", False)).run()
        assert complete_checkpoints(out)[-1].name == f"step_{planned_checkpoints(name)[-1]:06d}"
    else:
        from grpo_single_device import GRPORecipe

        GRPORecipe(cfg).run()


@pytest.fixture(scope="session")
def doc_workspace(tmp_path_factory):
    """``workspace(names)``: a scratch folder whose ``outputs/NAME`` holds each tiny run named (made
    once per session)."""
    root = tmp_path_factory.mktemp("doc_workspace")
    made: Dict[str, pathlib.Path] = {}

    def workspace(names):
        for name in sorted(set(names) - set(made)):
            assert name in TINY_RUNS, (f"a doc example reads outputs/{name}: add how to make that run to "
                                       f"TINY_RUNS in {pathlib.Path(__file__).name}")
            make_tiny_run(name, root / "outputs" / name)
            made[name] = root / "outputs" / name
        return root

    return workspace


# Runs the blocks in order in one namespace; names the block that fails.
DRIVER = """
import json, sys, traceback
namespace = {"__name__": "__main__"}
for where, code in json.load(open(sys.argv[1])):
    print(f"--- {where}", flush=True)
    try:
        exec(compile(code, where, "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"FAILED: the block at {where}", flush=True)
        sys.exit(1)
"""


@pytest.mark.slow
@pytest.mark.parametrize("doc", [d for d in DOCS if any(not b.fragment for b in python_blocks(d))],
                         ids=lambda d: d.name)
def test_python_blocks_run_as_written(doc, doc_workspace, tmp_path):
    blocks = [b for b in python_blocks(doc) if not b.fragment]
    cwd = doc_workspace([name for b in blocks for name in OUTPUT.findall(b.code)])
    script = tmp_path / "blocks.json"
    script.write_text(json.dumps([(b.where, b.code) for b in blocks]))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "components"), str(REPO / "recipes"),
                                                       os.environ.get("PYTHONPATH", "")]),
               CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-c", DRIVER, str(script)], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=TIMEOUT_S)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
