"""Makes the warm-start policy of configs/tiny_grpo.yaml with the SFT recipe (deterministic, ~10 s on a CPU).

The bundled tiny Qwen2.5 model starts from random weights and would never emit a digit, so GRPO
would see reward 0 everywhere. This script runs the SFT recipe (``SFTRecipe`` of
``recipes/full_sft_single_device.py``) on ``logitless.rl.prompts.arithmetic_warmstart_dataset`` ("a+b="
followed by the sum and the end-of-turn token) and stops early, after 50 steps of 32 examples: the
policy then answers in the right format ("<digit><|im_end|>") but is right only ~15% of the time
(reward < 0.2), and GRPO takes it from there. The embedding of the bundled random init is rescaled
to std 0.02 first (``well_scaled_init``). The final weights are stored in bf16 (HF format, 1.5 MB) in
components/logitless/rl/assets/tiny_grpo_warmstart/.

Run from the repository root:  python scripts/make_tiny_grpo_warmstart.py
(``--answers random`` trains the format only, with random digits: GRPO then learns much more slowly.)
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "components"), str(ROOT / "recipes")]
from logitless.datasets import TINY_CHECKPOINT_DIR  # noqa: E402
from logitless.training.checkpoint import complete_checkpoints  # noqa: E402
from full_sft_single_device import SFTRecipe  # noqa: E402

OUT = ROOT / "components/logitless/rl/assets/tiny_grpo_warmstart"


def well_scaled_init(work: Path) -> Path:
    """The bundled random init with its (tied) embedding rescaled to std 0.02, as HF initialises Qwen2.

    torchtune's ``nn.Embedding`` init is N(0, 1); tied to the head it gives logits of std ~11, a
    policy so sharp that one optimizer step of RL collapses its entropy.
    """
    src = load_file(str(TINY_CHECKPOINT_DIR / "model.safetensors"))
    key = "model.embed_tokens.weight"
    src[key] = (src[key].float() * (0.02 / src[key].float().std())).to(src[key].dtype)
    init = work / "init"
    init.mkdir()
    save_file(src, str(init / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(TINY_CHECKPOINT_DIR / "config.json", init / "config.json")
    return init


def main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--answers", default="correct", choices=("random", "correct"))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    out = Path(args.out)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="tiny_grpo_warmstart_"))
    init = well_scaled_init(work)
    cfg = OmegaConf.create({
        "output_dir": str(work / "run"),
        "model": {"_component_": "logitless.models.qwen2_5_tiny"},
        "tokenizer": {"_component_": "logitless.datasets.tiny_qwen2_5_tokenizer", "max_seq_len": 64},
        "dataset": {"_component_": "logitless.rl.prompts.arithmetic_warmstart_dataset",
                    "num_samples": 32 * args.steps, "answers": args.answers, "seed": 0},
        "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer",
                         "checkpoint_dir": str(init), "checkpoint_files": ["model.safetensors"],
                         "model_type": "QWEN2", "output_dir": str(work / "run")},
        "loss": {"_component_": "logitless.losses.LinearCrossEntropyLoss", "impl": "chunked"},
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 3e-3, "weight_decay": 0.0},
        "seed": 0, "batch_size": 32, "epochs": 1, "max_steps": args.steps, "clip_grad_norm": 1.0,
        "dtype": "fp32", "device": "cpu", "log_every_n_steps": 10,
        "metric_logger": {"_component_": "torchtune.training.metric_logging.StdoutLogger"},
    })
    losses = SFTRecipe(cfg).run()
    print(f"SFT loss: first {losses[0]:.3f}, last {losses[-1]:.3f} (uniform over 10 digits, EOS learnt: "
          f"{(torch.log(torch.tensor(10.0)) / 2):.3f} per label)")
    export_bf16(complete_checkpoints(work / "run")[-1], out)
    shutil.rmtree(work, ignore_errors=True)


def export_bf16(step_dir: Path, out: Path) -> None:
    """Writes the weights of the checkpoint ``step_dir`` in bf16 (one HF safetensors file) with the
    tiny model's ``config.json`` into ``out``: the bundled warm-start folder."""
    sd = {}
    for f in sorted(step_dir.glob("model-*.safetensors")):
        sd.update(load_file(str(f)))
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((TINY_CHECKPOINT_DIR / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {out} ({(out / 'model.safetensors').stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
