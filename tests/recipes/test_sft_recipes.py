"""End-to-end runs of the tiny SFT configs on CPU: loss falls, checkpoints, exact resume, packing,
LoRA adapters and merging, CLI entry points, distributed == single device; one run per output
folder (real processes), own damaged checkpoints repaired on resume, a full disk during a save."""

import errno
import glob
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import time

import pathlib

import pytest
import torch
from omegaconf import OmegaConf

from logitless.models import lora_qwen2_5_tiny, qwen2_5_tiny
from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

import logitless.training.checkpoint as ckpt_mod
from logitless.training import CheckpointManager, ConfigError, complete_checkpoints, read_disk_log
from logitless.training import model as model_utils
from logitless.training.checkpoint import MARKER, read_marker, read_run_file, verify_checkpoint
from logitless.training.run_lock import OutputDirLock
from full_sft_single_device import SFTRecipe, run_sft
from logitless.training.sft_config import validate_sft_config

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)
    return REPO


def tiny_config(name: str, out, **overrides):
    """A bundled tiny config with test-sized overrides (dotted keys)."""
    cfg = OmegaConf.load(REPO / "configs" / f"{name}.yaml")
    cfg.output_dir = str(out)
    for k, v in overrides.items():
        OmegaConf.update(cfg, k.replace("__", "."), v, merge=False)
    return cfg


FAST = dict(max_steps=12, batch_size=4, gradient_accumulation_steps=1, save_every_n_steps=None,
            lr_scheduler__num_warmup_steps=1)


def test_the_entry_point_frees_the_finished_run_before_it_returns(repo_cwd, tmp_path, refs_at_cleanup,
                                                                    one_rank_launch):
    """The model, its optimizer and the training step are gone when ``run_sft`` returns: sharded
    modules left to the interpreter's exit can abort a finished distributed run (gloo, SIGABRT);
    FSDP2 on a one-rank group puts them in reference cycles."""
    alive = refs_at_cleanup(SFTRecipe, "model", "optimizer", "train_step")
    run_sft(tiny_config("tiny_lora", tmp_path, **dict(FAST, max_steps=1)), lora=True, distributed=True)
    assert len(alive) == 3 and [r() for r in alive] == [None] * 3


def logged_losses(out):
    losses = {}
    for f in sorted(glob.glob(os.path.join(out, "logs", "log_*.txt"))):
        losses.update(read_disk_log(f).get("loss", {}))
    return losses


def assert_falls(losses, by):
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - by, f"loss did not fall by {by}: {losses}"


def test_tiny_full_loss_falls_and_checkpoints(repo_cwd, tmp_path):
    out = tmp_path / "full"
    losses = SFTRecipe(tiny_config("tiny_full", out, **FAST)).run()
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert_falls(losses, by=2.0)
    assert logged_losses(str(out)) == pytest.approx(dict(enumerate(losses, 1)))
    (ckpt,) = complete_checkpoints(out)
    assert ckpt.name == "step_000012"
    # the saved HF checkpoint is what the trained model holds: reload it and compare to a resumed run's input
    sd = CheckpointManager(OmegaConf.load("configs/tiny_full.yaml").checkpointer, str(tmp_path / "x")).load_model_state(ckpt)
    base = CheckpointManager(OmegaConf.load("configs/tiny_full.yaml").checkpointer, str(tmp_path / "y")).load_model_state()
    assert set(sd) == set(base) and not torch.equal(sd["norm.scale"], base["norm.scale"])


def test_resume_from_a_copied_mid_run_checkpoint_is_exact(repo_cwd, tmp_path):
    """Same config, checkpoint every 4 steps; resuming from step 4 in a fresh folder replays steps 5-8."""
    over = dict(FAST, max_steps=8, save_every_n_steps=4, keep_last_n_checkpoints=None,
                gradient_accumulation_steps=2, batch_size=2)
    ref = SFTRecipe(tiny_config("tiny_lora", tmp_path / "a", **over), lora=True).run()
    os.makedirs(tmp_path / "b")
    shutil.copytree(tmp_path / "a" / "step_000004", tmp_path / "b" / "step_000004")
    resumed = SFTRecipe(tiny_config("tiny_lora", tmp_path / "b", resume_from_checkpoint=True, **over), lora=True).run()
    assert resumed == ref[4:]  # bitwise: model, optimizer, LR schedule, data position, RNG restored


def test_tiny_lora_adapters_saved_separately_and_merged(repo_cwd, tmp_path):
    out = tmp_path / "lora"
    losses = SFTRecipe(tiny_config("tiny_lora", out, **FAST), lora=True).run()
    assert_falls(losses, by=2.0)
    ckpt = complete_checkpoints(out)[-1]
    for f in ("adapter_model.pt", "adapter/adapter_model.safetensors", "adapter/adapter_config.json",
              "model-00001-of-00001.safetensors", "config.json"):
        assert (ckpt / f).is_file(), f
    # the merged HF weights give the same logits as base + adapters
    cfg = OmegaConf.load("configs/tiny_lora.yaml")
    lora = lora_qwen2_5_tiny(**{k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "_component_"})
    base = CheckpointManager(cfg.checkpointer, str(tmp_path / "x")).load_model_state()
    adapters = CheckpointManager.load_adapter_state(ckpt)
    assert adapters and all("lora_" in k for k in adapters)
    lora.load_state_dict({**base, **adapters}, strict=True)
    merged = qwen2_5_tiny()
    merged.load_state_dict(CheckpointManager(cfg.checkpointer, str(tmp_path / "y")).load_model_state(ckpt))
    tokens = torch.randint(0, 2026, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens), lora.eval()(tokens), rtol=1e-4, atol=1e-4)
    # base weights untouched by LoRA training
    assert torch.equal(lora.tok_embeddings.weight, base["tok_embeddings.weight"])


def test_packed_fused_loss_ac_and_random_bf16_synthetic_overrides(repo_cwd, tmp_path):
    losses = SFTRecipe(tiny_config("tiny_full", tmp_path / "p", **dict(FAST, max_steps=6, batch_size=2),
                                   dataset__packed=True, enable_activation_checkpointing=True,
                                   loss={"_component_": "logitless.losses.LinearCrossEntropyLoss", "impl": "chunked"})).run()
    assert_falls(losses, by=1.0)
    syn = tiny_config("tiny_full", tmp_path / "s", **dict(FAST, max_steps=3), model_init="random", dtype="bf16",
                      tokenizer={"_component_": "logitless.datasets.synthetic_tokenizer", "vocab_size": 2048,
                                 "path": "/not/downloaded/vocab.json"},
                      dataset={"_component_": "logitless.datasets.synthetic_dataset", "seq_len": 32,
                               "num_samples": 16, "source": "tatsu-lab/alpaca"},
                      checkpointer__checkpoint_dir="/not/downloaded")
    losses = SFTRecipe(syn).run()
    # torchtune's builders initialise embeddings N(0, 1): a large but finite first loss
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert complete_checkpoints(tmp_path / "s")[-1].name == "step_000003"


@pytest.mark.parametrize("name", ["qwen2_5_0_5b_full", "qwen2_5_0_5b_lora", "qwen2_5_1_5b_full",
                                  "qwen2_5_1_5b_lora", "qwen2_5_7b_full", "qwen2_5_7b_lora"])
def test_real_configs_validate_with_random_synthetic_overrides(repo_cwd, tmp_path, name):
    cfg = OmegaConf.load(f"configs/{name}.yaml")
    cfg.output_dir = str(tmp_path)
    for o in ["model_init=random", "tokenizer._component_=logitless.datasets.synthetic_tokenizer",
              "tokenizer.vocab_size=151936", "dataset._component_=logitless.datasets.synthetic_dataset",
              "dataset.seq_len=4096"]:
        k, v = o.split("=")
        OmegaConf.update(cfg, k, OmegaConf.create(f"v: {v}").v, merge=True)
    validate_sft_config(cfg, lora=name.endswith("lora"), distributed=False)
    validate_sft_config(cfg.copy(), lora=name.endswith("lora"), distributed=True)
    # and without overrides they point at what `tune download` writes
    raw = OmegaConf.load(f"configs/{name}.yaml")
    assert raw.checkpointer.checkpoint_dir.startswith("/tmp/Qwen2.5-") and raw.model_init == "checkpoint"


@pytest.mark.slow
def test_tune_run_resume_after_kill_matches_uninterrupted(repo_cwd, tmp_path, tune_cli):
    over = ["max_steps=24", "batch_size=4", "gradient_accumulation_steps=1", "save_every_n_steps=4",
            "keep_last_n_checkpoints=2", "lr_scheduler.num_warmup_steps=1"]
    args = ["run", "full_sft_single_device", "--config", "configs/tiny_full.yaml", *over]
    out = tmp_path / "killed"
    p = tune_cli(args, out)
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:
        if any(int(d.name[5:]) >= 8 for d in complete_checkpoints(out)):
            break
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL, p.stdout.read()[-3000:]
    done = complete_checkpoints(out)
    assert done, "no checkpoint before the kill"
    at = int(done[-1].name[5:])
    assert 8 <= at < 24, f"killed at step {at}: the run was not interrupted mid-way"
    r = tune_cli(args + ["resume_from_checkpoint=true"], out)
    log = r.communicate(timeout=300)[0]
    assert r.returncode == 0, log[-3000:]
    resumed = logged_losses(str(out))
    ref_cfg = tiny_config("tiny_full", tmp_path / "ref", **{o.split("=")[0].replace(".", "__"): OmegaConf.create(f"v: {o.split('=')[1]}").v for o in over})
    ref = SFTRecipe(ref_cfg).run()
    assert len(ref) == 24
    for s in range(at + 1, 25):
        assert resumed[s] == pytest.approx(ref[s - 1], rel=1e-6, abs=1e-6), s


@pytest.mark.slow
def test_ctrl_c_ends_with_one_line_naming_the_last_checkpoint_and_resume_is_exact(repo_cwd, tmp_path, ctrl_c,
                                                                                     tune_cli):
    over = ["max_steps=24", "batch_size=4", "gradient_accumulation_steps=1", "save_every_n_steps=2",
            "lr_scheduler.num_warmup_steps=1"]
    args = ["run", "full_sft_single_device", "--config", "configs/tiny_full.yaml", *over]
    out = tmp_path / "run"
    status, log, reports = ctrl_c(args, out, after_step=2)
    assert status == 130, log[-3000:]
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    newest = complete_checkpoints(out)[-1]
    at = int(newest.name[5:])
    (report,) = reports  # one line, naming the newest complete checkpoint
    assert log.count("Interrupted") == 1 and report[1] == newest and 2 <= at <= report[0] < 24, log[-3000:]
    r = tune_cli(args + ["resume_from_checkpoint=auto"], out)
    resumed_log = r.communicate(timeout=300)[0]
    assert r.returncode == 0, resumed_log[-3000:]
    ref = SFTRecipe(tiny_config("tiny_full", tmp_path / "ref", max_steps=24, batch_size=4, gradient_accumulation_steps=1,
                                save_every_n_steps=None, lr_scheduler__num_warmup_steps=1)).run()
    resumed = logged_losses(str(out))
    assert [resumed[s] for s in range(at + 1, 25)] == ref[at:]


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_distributed_on_two_cpu_processes_matches_single_device_and_resumes(repo_cwd, tmp_path, tune_cli, lora):
    """full_sft_distributed / lora_sft_distributed against full_sft_single_device / lora_sft_single_device."""
    config = "tiny_lora" if lora else "tiny_full"
    over = ["max_steps=4", "batch_size=2", "gradient_accumulation_steps=2", "save_every_n_steps=2",
            "device=cpu", "lr_scheduler.num_warmup_steps=1"]
    args = ["run", "--nproc_per_node", "2", f"{'lora' if lora else 'full'}_sft_distributed",
            "--config", f"configs/{config}.yaml", *over]
    env = {"OMP_NUM_THREADS": "1"}
    p = tune_cli(args, tmp_path / "dist", env=env)
    log = p.communicate(timeout=300)[0]
    assert p.returncode == 0, log[-4000:]
    dist_losses = logged_losses(str(tmp_path / "dist"))
    # 2 ranks x micro-batch 2 == one device x micro-batch 4: same samples per step, same global token mean
    single = SFTRecipe(tiny_config(config, tmp_path / "single", max_steps=4, batch_size=4,
                                   gradient_accumulation_steps=2, save_every_n_steps=2 if lora else None,
                                   lr_scheduler__num_warmup_steps=1), lora=lora).run()
    assert_falls(single, by=0.1)  # the comparison has signal: the weights move
    assert [dist_losses[s] for s in range(1, 5)] == pytest.approx(single, rel=1e-5)
    # the distributed run's checkpoints are complete HF checkpoints; resuming one (sharded optimizer
    # state re-loaded from the full one) replays the same steps
    assert [d.name for d in complete_checkpoints(tmp_path / "dist")] == ["step_000002", "step_000004"]
    if lora:
        for name in ("step_000002", "step_000004"):
            _assert_same_lora_checkpoint(tmp_path / "dist" / name, tmp_path / "single" / name, tmp_path)
    os.makedirs(tmp_path / "resumed")
    shutil.copytree(tmp_path / "dist" / "step_000002", tmp_path / "resumed" / "step_000002")
    p = tune_cli(args + ["resume_from_checkpoint=true"], tmp_path / "resumed", env=env)
    log = p.communicate(timeout=300)[0]
    assert p.returncode == 0, log[-4000:]
    resumed = logged_losses(str(tmp_path / "resumed"))
    assert sorted(resumed) == [3, 4]
    assert [resumed[3], resumed[4]] == pytest.approx([dist_losses[3], dist_losses[4]], rel=1e-6)


def _assert_same_lora_checkpoint(dist, single, work):
    """A LoRA checkpoint as lora_sft_single_device writes it: the same files, the same PEFT and HF
    configs, adapters and merged weights equal up to summation order."""
    assert verify_checkpoint(dist) == [] and _file_hashes(dist).keys() == _file_hashes(single).keys()
    for f in ("adapter/adapter_config.json", "config.json"):
        assert (dist / f).read_text() == (single / f).read_text(), f
    a, b = CheckpointManager.load_adapter_state(dist), CheckpointManager.load_adapter_state(single)
    assert a.keys() == b.keys() and a and all("lora_" in k for k in a)
    for k in a:  # lora_b starts at 0: its size is how far training moved it
        assert (a[k] - b[k]).abs().max() <= 1e-3 * (b[k].abs().max() if "lora_b" in k else 1.0), k
    checkpointer = OmegaConf.load("configs/tiny_lora.yaml").checkpointer
    base = CheckpointManager(checkpointer, str(work / "base")).load_model_state()
    merged_dist = CheckpointManager(checkpointer, str(work / "md")).load_model_state(dist)
    merged_single = CheckpointManager(checkpointer, str(work / "ms")).load_model_state(single)
    assert merged_dist.keys() == merged_single.keys() == base.keys()
    for k in base:  # each tensor within 0.1% of how far training moved it (untouched ones: equal)
        moved = (merged_single[k] - base[k]).abs().max()
        assert (merged_dist[k] - merged_single[k]).abs().max() <= 1e-3 * moved + 1e-7, k


def _file_hashes(folder):
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(pathlib.Path(folder).rglob("*")) if p.is_file()}


def _no_model_build(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the model was built before the output folder / resume was checked")
    monkeypatch.setattr(model_utils, "build_model", fail)


def test_second_run_into_the_same_output_dir_is_refused_and_the_first_kept(repo_cwd, tmp_path, monkeypatch):
    """The user's case: a second run with other overrides into the first run's folder used to save
    steps that retention deleted (the first run's higher steps sorted last), and later overwrote them."""
    out = tmp_path / "out"
    SFTRecipe(tiny_config("tiny_full", out, **dict(FAST, max_steps=4, save_every_n_steps=2,
                                                    keep_last_n_checkpoints=2))).run()
    before = _file_hashes(out)
    assert [d.name for d in complete_checkpoints(out)] == ["step_000002", "step_000004"]
    _no_model_build(monkeypatch)
    with pytest.raises(ConfigError) as e:
        SFTRecipe(tiny_config("tiny_full", out, **dict(FAST, max_steps=3, batch_size=2, save_every_n_steps=1,
                                                       keep_last_n_checkpoints=2))).run()
    msg = str(e.value)
    for part in ("config key 'output_dir'", str(out), "step_000002", "step_000004", "logs",
                 "resume_from_checkpoint=auto", "another output_dir"):
        assert part in msg, (part, msg)
    assert _file_hashes(out) == before


def test_resume_falls_back_past_a_truncated_checkpoint_and_applies_a_new_lr(repo_cwd, tmp_path, monkeypatch, caplog):
    out = tmp_path / "out"
    over = dict(FAST, max_steps=2, save_every_n_steps=1, keep_last_n_checkpoints=None)
    SFTRecipe(tiny_config("tiny_full", out, **over)).run()
    weights = out / "step_000002" / "model-00001-of-00001.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 3)
    resume = dict(over, max_steps=4, resume_from_checkpoint="auto")
    # changed batch geometry / seed: refused before the model is built, every key listed
    with monkeypatch.context() as m:
        _no_model_build(m)
        with pytest.raises(ConfigError, match=r"'batch_size': 4 -> 2; 'seed': 0 -> 1 .*"
                                              r"resume_allow_changes=\[batch_size, seed\]"):
            SFTRecipe(tiny_config("tiny_full", out, **dict(resume, batch_size=2, seed=1))).run()
    caplog.clear()
    recipe = SFTRecipe(tiny_config("tiny_full", out, **dict(resume, optimizer__lr=1e-3)))
    with caplog.at_level(logging.INFO):
        losses = recipe.run()
    log = "\n".join(r.getMessage() for r in caplog.records)
    assert f"Skipping checkpoint {out / 'step_000002'}: {weights}: {size // 3} bytes, the marker records {size}" in log
    assert f"Resuming from {out / 'step_000001'}" in log
    assert "optimizer.lr: 0.003 -> 0.001 applied" in log and ".tmp" not in log
    assert log.count("Final model") == 1 and f"Final model (step 4): {out / 'step_000004'}" in log
    assert len(losses) == 3  # steps 2-4 redone from step 1
    # the lr after each step is the new base lr times the schedule's factor (a fresh schedule as reference)
    p = torch.nn.Parameter(torch.zeros(1))
    ref = torch.optim.SGD([p], lr=1e-3)
    sched = get_cosine_schedule_with_warmup(ref, num_warmup_steps=1, num_training_steps=4)
    for _ in range(4):
        sched.step()
    assert recipe.optimizer.param_groups[0]["initial_lr"] == 1e-3
    assert recipe.optimizer.param_groups[0]["lr"] == pytest.approx(ref.param_groups[0]["lr"], rel=1e-12)
    logged_lr = {}
    for f in glob.glob(str(out / "logs" / "log_*.txt")):
        logged_lr.update(read_disk_log(f).get("lr", {}))
    sched2 = get_cosine_schedule_with_warmup(torch.optim.SGD([p], lr=1e-3), num_warmup_steps=1, num_training_steps=4)
    for _ in range(3):
        sched2.step()
    assert logged_lr[3] == pytest.approx(sched2.get_last_lr()[0], rel=1e-6)  # the lr set for step 4
    # the damaged step_000002 was replaced by the resumed run's own
    assert verify_checkpoint(out / "step_000002") == []


class _NaNAfterFirstStep(torch.optim.SGD):
    """SGD whose first step leaves every parameter NaN (a diverged update, injected)."""

    def step(self, closure=None):
        out = super().step(closure)
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    p.fill_(float("nan"))
        return out


def test_nan_run_skips_steps_stops_after_three_and_writes_no_nan_checkpoint(repo_cwd, tmp_path, monkeypatch):
    """Step 1 turns every weight into NaN; steps 2-4 have NaN losses and gradients and are skipped
    (logged), and the run stops at step 4 naming it; a save of the NaN weights is refused."""
    from logitless.training.nonfinite import NonFiniteStepsError, NonFiniteWeightsError

    monkeypatch.setattr(torch.optim, "NaNAfterFirstStep", _NaNAfterFirstStep, raising=False)
    nan_opt = {"_component_": "torch.optim.NaNAfterFirstStep", "lr": 0.1}
    cfg = tiny_config("tiny_full", tmp_path / "a", **dict(FAST, max_steps=10))
    OmegaConf.update(cfg, "optimizer", nan_opt, merge=False)
    with pytest.raises(NonFiniteStepsError, match=r"3 optimizer steps in a row.*step 4"):
        SFTRecipe(cfg).run()
    log = read_disk_log(glob.glob(str(tmp_path / "a" / "logs" / "log_*.txt"))[0])
    assert log["skipped"] == {1: 0.0, 2: 1.0, 3: 1.0} and log["skipped_steps"] == {1: 0, 2: 1, 3: 2}
    assert complete_checkpoints(tmp_path / "a") == []
    cfg = tiny_config("tiny_full", tmp_path / "b", **dict(FAST, max_steps=3, save_every_n_steps=1))
    OmegaConf.update(cfg, "optimizer", nan_opt, merge=False)
    with pytest.raises(NonFiniteWeightsError, match="refusing to write checkpoint step_000001"):
        SFTRecipe(cfg).run()
    assert complete_checkpoints(tmp_path / "b") == [] and not list((tmp_path / "b").glob(".tmp-*"))


@pytest.mark.parametrize("value", [0, "three"])
def test_max_consecutive_skipped_steps_is_validated(repo_cwd, tmp_path, value):
    from logitless.rl.config import validate_grpo_config
    from logitless.training.config import ConfigError

    cfg = tiny_config("tiny_full", tmp_path, max_consecutive_skipped_steps=value)
    with pytest.raises(ConfigError, match="max_consecutive_skipped_steps"):
        validate_sft_config(cfg)
    gcfg = OmegaConf.load(REPO / "configs" / "tiny_grpo.yaml")
    gcfg.max_consecutive_skipped_steps = value
    with pytest.raises(ConfigError, match="max_consecutive_skipped_steps"):
        validate_grpo_config(gcfg)
    assert validate_sft_config(tiny_config("tiny_full", tmp_path)).max_consecutive_skipped_steps == 3


def _wait(procs, timeout):
    """The first of ``procs`` to exit, or None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                return p
        time.sleep(0.2)
    return None


def _wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow
def test_one_writer_per_output_dir_with_real_processes(tune_cli, tmp_path):
    """Two `tune run` started together into one folder (both with resume_from_checkpoint=auto, other
    settings): one trains, the other stops before building anything, naming the holder; a third
    started while the first trains is refused too; a kill -9 leaves no stale lock."""
    out = tmp_path / "out"
    args = ["run", "full_sft_single_device", "--config", "configs/tiny_full.yaml", "resume_from_checkpoint=auto",
            "batch_size=2", "gradient_accumulation_steps=1", "max_steps=100000", "save_every_n_steps=2",
            "keep_last_n_checkpoints=2", "lr_scheduler.num_warmup_steps=1"]
    env = {"LOGITLESS_DEBUG": ""}
    logs = {k: tmp_path / f"{k}.log" for k in ("a", "b", "c")}
    procs = []
    try:
        a = tune_cli([*args, "seed=0"], out, env=env, log=logs["a"])
        b = tune_cli([*args, "seed=7", "optimizer.lr=1e-3"], out, env=env, log=logs["b"])
        procs += [a, b]
        loser = _wait([a, b], timeout=150)
        assert loser is not None, "neither run stopped: both write into one output_dir"
        winner = b if loser is a else a
        text = logs["a" if loser is a else "b"].read_text()
        assert loser.returncode == 2, text[-3000:]
        assert f"ConfigError: config key 'output_dir': '{out}' is in use by another run: pid {winner.pid} on host " \
               in text, text[-3000:]
        assert "command: " in text and "tune run full_sft_single_device" in text and "Traceback" not in text
        assert "rows kept" not in text  # it stopped before building the dataset (nor the model)
        assert winner.poll() is None, logs["a" if winner is a else "b"].read_text()[-3000:]
        # one started while the first is training (it has saved a checkpoint) is refused as well
        _wait_for(lambda: complete_checkpoints(out), 120, "the first checkpoint")
        c = tune_cli([*args, "seed=0"], out, env=env, log=logs["c"])
        procs.append(c)
        assert _wait([c], timeout=120) is c, "a run joined the running one"
        text = logs["c"].read_text()
        assert c.returncode == 2 and f"is in use by another run: pid {winner.pid}" in text, text[-3000:]
        assert winner.poll() is None
        os.kill(winner.pid, signal.SIGKILL)
        winner.wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    # one writer: one log, one run id on every checkpoint, and no stale lock after kill -9
    (log,) = (out / "logs").glob("log_*.txt")
    assert log.read_text().count("Step 1 ") == 1
    run_id = read_run_file(out)["run_id"]
    assert {read_marker(d)["run_id"] for d in complete_checkpoints(out)} == {run_id}
    assert len(read_run_file(out)["sessions"]) == 1
    OutputDirLock(out).acquire().release()


def test_own_damage_is_moved_aside_and_rewritten(repo_cwd, tmp_path, caplog):
    """The user's case: with step_000008 deleted and the marker of step_000006 gone, `auto` resumed
    from step 4 without naming step 6 and died at step 6 ("written by another run") on every resume."""
    out = tmp_path / "out"
    over = dict(FAST, max_steps=8, save_every_n_steps=2, keep_last_n_checkpoints=None)
    first = SFTRecipe(tiny_config("tiny_full", out, **over)).run()
    shutil.rmtree(out / "step_000008")
    old_files = sorted(p.name for p in (out / "step_000006").iterdir())
    (out / "step_000006" / MARKER).unlink()
    with caplog.at_level(logging.INFO):
        resumed = SFTRecipe(tiny_config("tiny_full", out, **over, resume_from_checkpoint="auto")).run()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert f"Skipping checkpoint {out / 'step_000006'}: {out / 'step_000006' / MARKER}: missing" in text, text
    assert f"Resuming from {out / 'step_000004'}" in text
    (moved,) = (out / "damaged").iterdir()  # moved aside, whole: nothing deleted
    assert moved.name.startswith("step_000006-") and sorted(p.name for p in moved.iterdir()) == \
        [n for n in old_files if n != MARKER]
    assert f"Moved {out / 'step_000006'} aside to {moved}: " in text and "writes step 6 again" in text
    # steps 5-8 redone exactly; every checkpoint of the lineage complete and verifying
    assert resumed == first[4:]
    assert [d.name for d in complete_checkpoints(out)] == ["step_000002", "step_000004", "step_000006", "step_000008"]
    assert all(verify_checkpoint(d) == [] for d in complete_checkpoints(out))


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 14 MiB tmpfs (one tiny_full checkpoint is 9 MiB: a second does not fit); skipped where
    this machine does not allow mounting."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=14m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_during_a_save_says_so_and_leaves_nothing_partial(repo_cwd, small_tmpfs, capsys):
    """A real full disk: torch.save reports it as 'RuntimeError: [enforce fail at inline_container.cc]
    unexpected pos' (no errno); the run stops with one line naming it, exit status 1."""
    out = small_tmpfs / "out"
    with pytest.raises(SystemExit) as e:
        run_sft(tiny_config("tiny_full", out, **dict(FAST, max_steps=2, save_every_n_steps=1)), lora=False, distributed=False)
    assert e.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith(f"CheckpointSaveError: could not write checkpoint step_000002 to {out}: no space left on "
                          f"device (RuntimeError: "), err
    for part in ("It needs about 8.", "MiB was free on that file system when the save began",
                 f"earlier checkpoints are kept (newest: {out / 'step_000001'})", "on_save_error=stop"):
        assert part in err, (part, err)
    assert [d.name for d in complete_checkpoints(out)] == ["step_000001"] and verify_checkpoint(out / "step_000001") == []
    assert sorted(p.name for p in out.iterdir()) == ["logitless_run.json", "logs", "step_000001",
                                                     "torchtune_config.yaml"]  # no staging, no temporary file


def test_on_save_error_continue_trains_on_and_saves_at_the_next_save(repo_cwd, tmp_path, monkeypatch, caplog):
    """The OS error simulated (ENOSPC from the write of step 2's recipe state): with
    on_save_error=continue the run logs it, trains on, and step 3 is saved."""
    real_save, calls = ckpt_mod.torch.save, []

    def save(obj, path, *a, **k):
        calls.append(pathlib.Path(path).name)
        if len(calls) == 2:
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(ckpt_mod.torch, "save", save)
    out = tmp_path / "out"
    cfg = tiny_config("tiny_full", out, **dict(FAST, max_steps=3, save_every_n_steps=1, keep_last_n_checkpoints=None),
                      on_save_error="continue")
    with caplog.at_level(logging.INFO):
        losses = SFTRecipe(cfg).run()
    assert len(losses) == 3 and calls == ["recipe_state.pt"] * 3
    assert [d.name for d in complete_checkpoints(out)] == ["step_000001", "step_000003"]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert (f"could not write checkpoint step_000002 to {out}: no space left on device (OSError: [Errno 28] No space "
            f"left on device)") in text and "Training goes on (on_save_error=continue)" in text
    assert f"Final model (step 3): {out / 'step_000003'}" in text


def test_on_save_error_is_validated(tmp_path):
    from logitless.rl.config import validate_grpo_config

    expected = r"config key 'on_save_error': expected one of \['stop', 'continue'\], got 'retry'"
    with pytest.raises(ConfigError, match=expected):
        validate_sft_config(tiny_config("tiny_full", tmp_path, on_save_error="retry"))
    gcfg = OmegaConf.load(REPO / "configs" / "tiny_grpo.yaml")
    gcfg.on_save_error = "retry"
    with pytest.raises(ConfigError, match=expected):
        validate_grpo_config(gcfg)
    assert validate_sft_config(tiny_config("tiny_full", tmp_path)).on_save_error == "stop"
