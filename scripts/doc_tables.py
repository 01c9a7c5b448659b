#!/usr/bin/env python
"""The tables and figures README.md and docs/ quote, regenerated from committed results.

    python scripts/doc_tables.py              # every table below, as Markdown
    python scripts/doc_tables.py quickstart   # or: head, capacity, models

- ``quickstart``: ``reward/mean`` of the tiny GRPO run per seed (``benchmarks/results/
  tiny_grpo_cpu_metrics*.txt``: seed 0 is ``tiny_grpo_cpu_metrics.txt``), and the range over seeds.
- ``head``: the LM head at the Qwen2.5-7B shape (``head_final_h200.csv``): time and peak extra memory
  per implementation.
- ``capacity``: the longest sequence per model and loss (``capacity_nvidia_h100_80gb_hbm3.csv``).
- ``models`` (docs/models.md): Qwen3-1.7B next to Qwen2.5-1.5B on one H100: the GRPO step (``grpo_step_qwen3_h100.csv``),
  decode at 64 rows and its share of the roofline with each group's prompt read once
  (``generation_qwen3_h100.csv``), the longest SFT sequence with our loss (the capacity CSV).

Only reads files; reads no GPU and imports no torch.
"""

import argparse
import csv
import re
from pathlib import Path
from statistics import mean

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
SEED_LOGS = {0: "tiny_grpo_cpu_metrics.txt", 1: "tiny_grpo_cpu_metrics_seed1.txt",
             2: "tiny_grpo_cpu_metrics_seed2.txt"}
HEAD_NAMES = {"compile": "`torch.compile` of plain PyTorch", "tt_compiled": "torchtune chunked loss, compiled",
              "liger": "Liger-Kernel {liger_kernel}", "cce": "Cut Cross-Entropy {cut_cross_entropy}",
              "quack": "QuACK {quack_kernels} `chunked_linear_cross_entropy`",
              "chunked": "logitless `impl=\"chunked\"`", "triton": "**logitless `impl=\"triton\"`**"}


def step_rewards(path: Path) -> dict:
    """``{step: reward/mean}`` of a recipe log (lines ``Step N | key:value ...``)."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"Step (\d+) \|.* reward/mean:(\S+)", line)
        if m:
            out[int(m.group(1))] = float(m.group(2))
    return out


def quickstart() -> str:
    rows = ["| seed | step 1 | step 50 | step 100 | mean of steps 91-100 |", "|---|---:|---:|---:|---:|"]
    cols = {"1": [], "50": [], "100": [], "91-100": []}
    for seed, name in SEED_LOGS.items():
        r = step_rewards(RESULTS / name)
        vals = {"1": r[1], "50": r[50], "100": r[100], "91-100": mean(r[s] for s in range(91, 101))}
        for k, v in vals.items():
            cols[k].append(v)
        rows.append(f"| {seed} | " + " | ".join(f"{v:.2f}" for v in vals.values()) + " |")
    rows.append("| range | " + " | ".join(f"{min(v):.2f}-{max(v):.2f}" for v in cols.values()) + " |")
    return "\n".join(rows)


def head(shape: str = "qwen7b", csv_name: str = "head_final_h200.csv") -> str:
    with open(RESULTS / csv_name, newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["shape"] == shape and r["ms"]]
    cell = {(r["impl"], r["mode"]): r for r in rows}
    first = rows[0]
    out = [f"{first['gpu']}, torch {first['torch']}, {shape} head (N={first['N']}, H={first['H']}, V={first['V']}), "
           f"{first['date']} (`{csv_name}`)", "",
           "| | cross-entropy fwd+bwd | log-probs + entropy fwd+bwd | GRPO objective fwd+bwd | extra memory (CE) |",
           "|---|---:|---:|---:|---:|"]
    for impl, name in HEAD_NAMES.items():
        if not any(k[0] == impl for k in cell):
            continue
        ms = [f"{float(cell[(impl, m)]['ms']):.1f} ms" if (impl, m) in cell else "n/a" for m in ("ce", "logp", "obj")]
        mem = f"{float(cell[(impl, 'ce')]['peak_extra_gib']):.2f} GiB" if (impl, "ce") in cell else "n/a"
        out.append(f"| {name.format(**first)} | " + " | ".join(ms) + f" | {mem} |")
    return "\n".join(out)


def capacity(csv_name: str = "capacity_nvidia_h100_80gb_hbm3.csv") -> str:
    with open(RESULTS / csv_name, newline="") as fh:
        rows = list(csv.DictReader(fh))
    first = rows[0]
    out = [f"{first['gpu']}, torch {first['torch']}, torchtune {first['torchtune']}, Liger {first['liger']}, "
           f"{first['date']} (`{csv_name}`)", "",
           "| model | loss | offload | longest that fit | its peak | its step | first miss |",
           "|---|---|---|---:|---:|---:|---|"]
    for key in dict.fromkeys((r["model"], r["mode"], r["loss"], r["offload"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["mode"], r["loss"], r["offload"]) == key]
        ok = [r for r in mine if r["status"] == "ok"]
        miss = [int(r["seq_len"]) for r in mine if r["status"] != "ok"]
        best = max(ok, key=lambda r: int(r["seq_len"])) if ok else None
        longest = f"{int(best['seq_len']) // 1024}k" if best else "-"
        peak = f"{float(best['peak_gib']):.1f} GiB" if best else "-"
        step = f"{float(best['step_s']):.1f} s" if best else "-"
        first_miss = f"OOM at {min(miss) // 1024}k" if miss else "none up to the largest tried"
        out.append(f"| {key[0]} {key[1]} | {key[2]} | {key[3]} | {longest} | {peak} | {step} | {first_miss} |")
    return "\n".join(out)


def models() -> str:
    def read(name):
        with open(RESULTS / name, newline="") as fh:
            return list(csv.DictReader(fh))

    names = {"1.5b": "Qwen2.5-1.5B", "qwen3_1_7b": "Qwen3-1.7B"}
    steps = {r["model"]: r for r in read("grpo_step_qwen3_h100.csv") if r["status"] == "ok"}
    decode = {r["model"]: r for r in read("generation_qwen3_h100.csv")
              if r["rows"] == "64" and r["mix"] == "uniform" and r["status"] == "ok"}
    fits = {}
    for r in read("capacity_nvidia_h100_80gb_hbm3.csv"):
        if r["loss"] == "logitless_fused" and r["mode"] == "full" and r["offload"] == "False":
            fits.setdefault(r["model"], []).append(r)
    out = ["| model | GRPO step (8 prompts x 8, 512 + 512 tokens) | decode, 64 rows x 512 tokens | its share of the "
           "roofline | longest SFT sequence |", "|---|---:|---:|---:|---:|"]
    for key, name in names.items():
        ok = [int(r["seq_len"]) for r in fits[key] if r["status"] == "ok"]
        missed = any(r["status"] != "ok" for r in fits[key])
        longest = f"{max(ok) // 1024}k" if missed else f">= {max(ok) // 1024}k"
        d = decode[key]
        out.append(f"| {name} | {float(steps[key]['step_s']):.2f} s | {float(d['tokens_per_s']):,.0f} tokens/s | "
                   f"{float(d['roofline_shared_frac']):.0%} | {longest} |")
    return "\n".join(out)


def main() -> None:
    tables = {"quickstart": quickstart, "head": head, "capacity": capacity, "models": models}
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("tables", nargs="*", choices=[*tables, []], help="default: all")
    for name in p.parse_args().tables or tables:
        print(f"### {name}\n\n{tables[name]()}\n")


if __name__ == "__main__":
    main()
