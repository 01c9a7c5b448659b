"""Makes the warm-start policy of configs/tiny_grpo_tools.yaml with the SFT recipe (deterministic, CPU).

The tiny policy is trained on whole tool conversations (``logitless.rl.tool_arithmetic.
tool_arithmetic_warmstart_dataset``): half of them call the calculator with the question's
expression ("a*b", 2-digit operands) and copy its answer after ``####``, the other half answer at
once. Two phases: ``--short-steps`` on rows without the tools block in the system turn (~4x
shorter, the same relative positions: where the copying is learnt, cheaply), then ``--steps`` on
rows rendered exactly as the rollout renders them. The model cannot multiply, so afterwards it
calls the tool in some trajectories (a third of them at GRPO's first step) and gets those right,
and guesses (wrongly) in the others: GRPO then has a reward that only the tool reaches. It starts from the same rescaled random
init as the arithmetic warm start (``make_tiny_grpo_warmstart.well_scaled_init``);
the final weights are stored in bf16 (HF format, 1.5 MB) in
components/logitless/rl/assets/tiny_grpo_tools_warmstart/.

Run from the repository root:  python scripts/make_tiny_grpo_tools_warmstart.py
"""

import shutil
import sys
import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "components"), str(ROOT / "recipes"), str(ROOT / "scripts")]
from logitless.training.checkpoint import complete_checkpoints  # noqa: E402
from full_sft_single_device import SFTRecipe  # noqa: E402
from make_tiny_grpo_warmstart import export_bf16, well_scaled_init  # noqa: E402

OUT = ROOT / "components/logitless/rl/assets/tiny_grpo_tools_warmstart"


def main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--short-steps", type=int, default=500,
                   help="first phase: steps on rows without the tools block in the system turn (~4x shorter)")
    p.add_argument("--short-batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=100, help="second phase: steps on rows rendered as the rollout does")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--tool-fraction", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    out = Path(args.out)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="tiny_grpo_tools_warmstart_"))
    init = well_scaled_init(work)
    if args.short_steps:
        init = _sft(work / "short", init, args, steps=args.short_steps, batch_size=args.short_batch_size,
                    tools_in_prompt=False)
    export_bf16(_sft(work / "run", init, args, steps=args.steps, batch_size=args.batch_size, tools_in_prompt=True),
                out)
    shutil.rmtree(work, ignore_errors=True)


def _sft(run: Path, init: Path, args, *, steps: int, batch_size: int, tools_in_prompt: bool) -> Path:
    """One SFT phase from the HF folder ``init``; returns its last checkpoint folder."""
    files = sorted(p.name for p in init.glob("model*.safetensors"))
    cfg = OmegaConf.create({
        "output_dir": str(run),
        "model": {"_component_": "logitless.models.qwen2_5_tiny"},
        "tokenizer": {"_component_": "logitless.datasets.tiny_qwen2_5_tokenizer", "max_seq_len": 1024},
        "dataset": {"_component_": "logitless.rl.tool_arithmetic.tool_arithmetic_warmstart_dataset",
                    "num_samples": batch_size * steps, "tool_fraction": args.tool_fraction,
                    "tools_in_prompt": tools_in_prompt, "seed": int(tools_in_prompt)},
        "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer",
                         "checkpoint_dir": str(init), "checkpoint_files": files,
                         "model_type": "QWEN2", "output_dir": str(run)},
        "loss": {"_component_": "logitless.losses.LinearCrossEntropyLoss", "impl": "chunked"},
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": args.lr, "weight_decay": 0.0},
        "seed": 0, "batch_size": batch_size, "epochs": 1, "max_steps": steps, "clip_grad_norm": 1.0,
        "dtype": "fp32", "device": "cpu", "log_every_n_steps": 10,
        "metric_logger": {"_component_": "torchtune.training.metric_logging.StdoutLogger"},
    })
    losses = SFTRecipe(cfg).run()
    print(f"SFT ({'tools in the prompt' if tools_in_prompt else 'short rows'}): loss first {losses[0]:.3f}, "
          f"last {losses[-1]:.3f}")
    return complete_checkpoints(run)[-1]


if __name__ == "__main__":
    main()
