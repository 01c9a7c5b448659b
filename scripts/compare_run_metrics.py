#!/usr/bin/env python
"""Compare the per-step metrics of two sets of tiny runs (torchtune DiskLogger files).

usage: python scripts/compare_run_metrics.py BASE_DIR NEW_DIR

Each run is a sub-folder RUN/logs/log_*.txt (as scripts/tiny_runs.sh writes: full, fused, lora, grpo).
Used to show that a refactor leaves training unchanged: run scripts/tiny_runs.sh on the old and
the new checkout, then compare.
For every run present in both folders, prints per metric the max absolute and relative
difference over the common steps, and flags steps or metrics present in only one of them.
Time, throughput and memory keys are skipped. Exit status 1 when any run or metric is missing.
"""

import glob
import os
import sys

from logitless.training.metric_logging import read_disk_log

SKIP_PREFIXES = ("time/", "step_time", "tokens_per_second", "peak_", "memory", "mem/")


def run_logs(root):
    """{run name: merged metrics} for every RUN/logs/log_*.txt under ``root``."""
    runs = {}
    for run in sorted(os.listdir(root)):
        files = sorted(glob.glob(os.path.join(root, run, "logs", "log_*.txt")))
        if not files:
            continue
        merged = {}
        for f in files:
            for k, steps in read_disk_log(f).items():
                merged.setdefault(k, {}).update(steps)
        runs[run] = merged
    return runs


def skipped(key):
    return any(key.startswith(p) or ("/" + p) in key for p in SKIP_PREFIXES)


def main(base_dir, new_dir):
    base, new = run_logs(base_dir), run_logs(new_dir)
    problems = 0
    for run in sorted(set(base) | set(new)):
        if run not in base or run not in new:
            print(f"[{run}] only in {'BASE' if run in base else 'NEW'}")
            problems += 1
            continue
        b, n = base[run], new[run]
        print(f"[{run}]")
        print(f"  {'metric':32s} {'steps':>5s} {'max abs diff':>13s} {'max rel diff':>13s}")
        worst_rel = 0.0
        for key in sorted(set(b) | set(n)):
            if skipped(key):
                continue
            if key not in b or key not in n:
                print(f"  {key:32s} only in {'BASE' if key in b else 'NEW'}")
                problems += 1
                continue
            steps = sorted(set(b[key]) & set(n[key]))
            if set(b[key]) != set(n[key]):
                print(f"  {key:32s} steps differ: base {len(b[key])}, new {len(n[key])}")
                problems += 1
            abs_d = max((abs(b[key][s] - n[key][s]) for s in steps), default=0.0)
            rel_d = max((abs(b[key][s] - n[key][s]) / max(abs(b[key][s]), 1e-12) for s in steps), default=0.0)
            worst_rel = max(worst_rel, rel_d)
            print(f"  {key:32s} {len(steps):5d} {abs_d:13.3e} {rel_d:13.3e}")
        print(f"  worst relative difference: {worst_rel:.3e}")
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
