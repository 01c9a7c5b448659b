"""Plots of the SFT and GRPO benchmark CSVs for docs/ (the head benchmark plots itself: bench_head.py --plot).

    python benchmarks/plot_results.py       # docs/img/sft_h200.png, grpo_h200.png, grpo_grid_h200.png
    python benchmarks/plot_results.py --sft benchmarks/results/sft_h200.csv --grpo benchmarks/results/grpo_step_h200.csv
"""

import argparse
import csv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SFT_VARIANTS = ["torchtune_chunked", "torchtune_plain", "logitless_chunked", "logitless_fused"]


def _rows(path):
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("status") == "ok"]


def _bars(ax, groups, series, values, ylabel, title):
    """Grouped bars: ``values[(group, series)]``; missing pairs leave a gap."""
    width = 0.8 / len(series)
    for i, name in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ys = [values.get((grp, name), 0.0) for grp in groups]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)


def plot_sft(csv_path, png_path, plt):
    """Head time and head memory (the step minus the no-head step) per model/shape and loss."""
    rows = [r for r in _rows(csv_path) if r["head_ms"] not in ("", "nan")]
    groups = list(dict.fromkeys(f"{r['model'].replace('qwen2_5_', '')} {r['batch']}x{r['seq']}" for r in rows))
    key = {(f"{r['model'].replace('qwen2_5_', '')} {r['batch']}x{r['seq']}", r["variant"]): r for r in rows}
    series = [v for v in SFT_VARIANTS if any(k[1] == v for k in key)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    _bars(axes[0], groups, series, {k: float(r["head_ms"]) for k, r in key.items()}, "ms",
          "SFT step: head time (step - no-head step)")
    _bars(axes[1], groups, series, {k: float(r["head_mem_gib"]) for k, r in key.items()}, "GiB",
          "SFT step: head memory (peak - no-head peak)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


def plot_grpo(csv_path, png_path, plt, trl_csv=None):
    """Update time and update peak per path; TRL's whole step beside ours."""
    rows = [r for r in _rows(csv_path) if r["impl"] != "no_head"]
    groups = list(dict.fromkeys(r["model"] for r in rows))
    series = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    _bars(axes[0], groups, series, {(r["model"], r["impl"]): float(r["update_s"]) for r in rows}, "s",
          "GRPO update (G=16, 1024 + 512)")
    _bars(axes[1], groups, series, {(r["model"], r["impl"]): float(r["update_peak_gib"]) for r in rows}, "GiB",
          "GRPO update peak (weights + AdamW included)")
    step = {(r["model"], r["impl"]): float(r["step_s"]) for r in rows}
    if trl_csv and Path(trl_csv).exists():
        for r in _rows(trl_csv):
            if r["group"] == "16" and r["completion_len"] == "512":
                step[(r["model"], "TRL 1.16")] = float(r["step_s"])  # the last row of a model wins
    _bars(axes[2], groups, list(dict.fromkeys(k[1] for k in step)), step, "s", "whole GRPO step (sampling + update)")
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


GRID_IMPLS = ["full_logits", "chunked", "triton", "triton+prompt_once", "triton+prompt_once_flex"]


def plot_grid(csv_path, png_path, plt):
    """The update-only grid: time and peak per (model, G, prompt, completion) and path."""
    rows = _rows(csv_path)
    label = lambda r: f"{r['model']} G{r['G']}\n{r['prompt_len']}+{r['completion_len']}"  # noqa: E731
    groups = list(dict.fromkeys(label(r) for r in rows))
    key = {(label(r), r["impl"]): r for r in rows if r["impl"] in GRID_IMPLS}
    fig, axes = plt.subplots(2, 1, figsize=(17, 7.5))
    _bars(axes[0], groups, GRID_IMPLS, {k: float(r["update_s"]) for k, r in key.items()}, "s",
          "GRPO update, one group per micro-batch (missing bar: packed group over max_seq_len)")
    _bars(axes[1], groups, GRID_IMPLS, {k: float(r["update_peak_gib"]) for k, r in key.items()}, "GiB",
          "GRPO update peak (weights + AdamW included)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
        ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sft", default=str(ROOT / "benchmarks/results/sft_h200.csv"))
    p.add_argument("--grpo", default=str(ROOT / "benchmarks/results/grpo_step_h200.csv"))
    p.add_argument("--trl", default=str(ROOT / "benchmarks/results/trl_grpo_h200.csv"))
    p.add_argument("--grid", default=str(ROOT / "benchmarks/results/grpo_update_grid_h200.csv"))
    p.add_argument("--out-dir", default=str(ROOT / "docs/img"))
    a = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_sft(a.sft, out / "sft_h200.png", plt)
    plot_grpo(a.grpo, out / "grpo_h200.png", plt, a.trl)
    plot_grid(a.grid, out / "grpo_grid_h200.png", plt)
    print(f"wrote sft_h200.png, grpo_h200.png and grpo_grid_h200.png in {out}")


if __name__ == "__main__":
    main()
