"""The markdown tables of the split-K measurements (summarised in docs/history.md), regenerated from the committed CSVs.

- the decode step against the roofline (``generation_roofline_h200.csv``, rows measured since
  ``--since``, uniform and mix of each (model, rows, attention) side by side);
- decode attention alone (``decode_attention_h200.csv``): the windowed SDPA, SDPA over the whole
  cache and the split-K kernel per layer, at each model's attention shape;
- split-K's split length (``decode_attention_split_len_h200.csv``): each fixed length against the
  automatic rule before and after it changed (the file's first run and its last);
- long-prompt prefill (``prefill_h200.csv``): chunked against one forward, time and memory;
- programmatic dependent launches (``generation_programmatic_launch_h200.csv``): the decode step
  before and after, per setting of one run;
- one decode step's kernel time and launches by category (``decode_step_breakdown_h200.csv``);
- the benchmark's whole grid on one version of the code (``generation_grid_h200.csv``: three
  models, 16 and 64 rows, 512 and 2048 new tokens), in the decode step's table format.

Usage:
    python experiments/generation_tables.py [--results experiments/results] [--since 2026-11-23T14]
"""

import argparse
import csv
from pathlib import Path
from typing import Dict, List

MODEL_NAMES = {"0.5b": "Qwen2.5-0.5B", "1.5b": "Qwen2.5-1.5B", "7b": "Qwen2.5-7B"}
_ORDER = list(MODEL_NAMES)


def _case_order(case) -> tuple:
    # (model, rows, a number, ...): model in MODEL_NAMES' order, then the counts numerically
    return (_ORDER.index(case[0]), int(case[1]), int(case[2] or 0), *case[3:])


def _read(path: Path) -> List[Dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def decode_step_table(rows: List[Dict[str, str]], since: str) -> str:
    """Decode step per (model, rows, new tokens, attention, options): step time, roofline share,
    uniform and mix tokens/s.

    Args:
        rows (List[Dict[str, str]]): rows of ``bench_generation.py``'s CSV.
        since (str): keep rows whose ``date`` sorts at or after this ISO prefix.

    Returns:
        str: a markdown table (the run's ``--compiled-options`` and the UTC hour it was measured in
        the last columns; a later row of the same case replaces an earlier one).
    """
    kept = [r for r in rows if r["date"] >= since and r.get("decode_attention")]

    def case(r):
        return r["model"], r["rows"], r.get("new_tokens", ""), r["decode_attention"], r.get("options", "")

    uniform = {case(r): r for r in kept if r["mix"] == "uniform"}
    mix = {case(r): r for r in kept if r["mix"] == "mix"}
    out = ["| model | rows | new tokens | attention | step (ms) | roofline (ms) | of roofline | uniform tok/s | "
           "mix tok/s (mean length) | options | measured |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for key in sorted(uniform, key=_case_order):
        u, m = uniform[key], mix.get(key)
        mixed = f"{float(m['tokens_per_s']):,.0f} ({float(m['mean_len']):.0f})" if m else "-"
        out.append(f"| {MODEL_NAMES[key[0]]} | {key[1]} | {key[2]} | {key[3]} | {float(u['step_ms']):.3f} | "
                   f"{float(u['roofline_ms']):.3f} | {100 * float(u['roofline_frac']):.1f}% | "
                   f"{float(u['tokens_per_s']):,.0f} | {mixed} | {key[4]} | {u['date'][:13].replace('T', ' ')}h |")
    return "\n".join(out)


def programmatic_launch_table(rows: List[Dict[str, str]]) -> str:
    """The decode step per model and setting of ``generation_programmatic_launch_h200.csv``.

    Args:
        rows (List[Dict[str, str]]): rows with ``setting`` and ``date`` besides bench_generation's columns.

    Returns:
        str: a markdown table, runs in file order (a run's uniform and mix rows share its date).
    """
    mix = {(r["date"], r["model"], r["setting"]): r for r in rows if r["mix"] == "mix"}
    out = ["| run (UTC) | model | setting | step (ms) | of roofline | mix call (s) | mix tok/s |",
           "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if r["mix"] != "uniform":
            continue
        m = mix.get((r["date"], r["model"], r["setting"]))
        mixed = f"{float(m['seconds']):.3f} | {float(m['tokens_per_s']):,.0f}" if m else "- | -"
        out.append(f"| {r['date'][:16].replace('T', ' ')} | {MODEL_NAMES[r['model']]} | {r['setting']} | "
                   f"{float(r['step_ms']):.3f} | {100 * float(r['roofline_frac']):.1f}% | {mixed} |")
    return "\n".join(out)


def step_breakdown_table(rows: List[Dict[str, str]]) -> str:
    """Kernel time and launches per decode step by category, one column pair per (model, code).

    Args:
        rows (List[Dict[str, str]]): rows of ``decode_step_breakdown_h200.csv``.

    Returns:
        str: a markdown table; its first row is the step's wall time.
    """
    runs = list(dict.fromkeys((r["model"], r["code"]) for r in rows))
    cats = list(dict.fromkeys(r["category"] for r in rows))
    by = {(r["model"], r["code"], r["category"]): r for r in rows}
    wall = {(r["model"], r["code"]): r["wall_us"] for r in rows}
    out = ["| us / step (launches) | " + " | ".join(f"{MODEL_NAMES[m]}, {c}" for m, c in runs) + " |",
           "|---|" + "---:|" * len(runs),
           "| wall | " + " | ".join(f"{float(wall[run]):.0f}" for run in runs) + " |"]
    for cat in cats:
        cells = []
        for model, code in runs:
            r = by.get((model, code, cat))
            cells.append(f"{float(r['us_per_step']):.0f} ({float(r['launches_per_step']):.0f})" if r else "-")
        out.append(f"| {cat} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def attention_table(rows: List[Dict[str, str]]) -> str:
    """Per-layer decode attention: SDPA over the window and the whole cache against split-K.

    Args:
        rows (List[Dict[str, str]]): rows of ``bench_decode_attention.py``'s CSV (the automatic
            split length: one ``split_k`` row per case).

    Returns:
        str: a markdown table.
    """
    by = {(r["model"], r["rows"], r["filled"], r["method"]): r for r in rows}
    out = ["| model | rows | filled | SDPA window (us) | SDPA whole cache (us) | split-K (us) | "
           "split-K / window | split-K of copy bandwidth |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    cases = sorted({k[:3] for k in by if k[3] == "split_k"}, key=_case_order)
    for model, n, filled in cases:
        split = by[(model, n, filled, "split_k")]
        window = float(by[(model, n, filled, "sdpa_window")]["us"])
        whole = float(by[(model, n, filled, "sdpa_full")]["us"])
        us = float(split["us"])
        out.append(f"| {MODEL_NAMES[model]} | {n} | {filled} | {window:.1f} | {whole:.1f} | {us:.1f} | "
                   f"{us / window:.2f} | {100 * float(split['of_copy_bw']):.0f}% |")
    return "\n".join(out)


def split_length_table(rows: List[Dict[str, str]], block_n: str = "64") -> str:
    """Split-K per layer at each split length, and the automatic rule of the first run against the last.

    Args:
        rows (List[Dict[str, str]]): ``split_k`` rows of ``bench_decode_attention.py --split-lens``
            runs with a ``resolved_split_len`` column, from two or more runs (told apart by ``date``).
        block_n (str): the ``block_n`` whose rows are shown (the kernel's default).

    Returns:
        str: a markdown table; a fixed length's time is the latest run's.
    """
    kept = sorted((r for r in rows if r["method"] == "split_k" and r["status"] == "ok" and r["block_n"] == block_n),
                  key=lambda r: r["date"])
    first, last = kept[0]["date"], kept[-1]["date"]
    lengths = sorted({int(r["split_len"]) for r in kept if r["split_len"] != "auto"})
    fixed, auto = {}, {}
    for r in kept:  # later rows overwrite earlier ones
        case = (r["model"], r["rows"], r["filled"])
        if r["split_len"] == "auto":
            if r["date"] in (first, last):
                auto[case, r["date"] == last] = r
        else:
            fixed[case, int(r["split_len"])] = float(r["us"])
    cases = sorted({case for case, _ in auto}, key=_case_order)
    out = ["| model | rows | filled | " + " | ".join(f"split {n} (us)" for n in lengths) +
           " | rule before: split, us | rule now: split, us | now / before |",
           "|---|---:|---:|" + "---:|" * (len(lengths) + 3)]
    for case in cases:
        before, now = auto.get((case, False)), auto.get((case, True))
        if before is None or now is None:
            continue
        times = " | ".join(f"{fixed[case, n]:.1f}" if (case, n) in fixed else "-" for n in lengths)
        out.append(f"| {MODEL_NAMES[case[0]]} | {case[1]} | {case[2]} | {times} | "
                   f"{before['resolved_split_len']}, {float(before['us']):.1f} | "
                   f"{now['resolved_split_len']}, {float(now['us']):.1f} | "
                   f"{float(now['us']) / float(before['us']):.2f} |")
    return "\n".join(out)


def prefill_table(rows: List[Dict[str, str]]) -> str:
    """Prefill per (model, prompts, width): chunked against one forward, side by side.

    Args:
        rows (List[Dict[str, str]]): rows of ``bench_prefill.py``'s CSV (``chunk_tokens`` a number
            or ``none``).

    Returns:
        str: a markdown table; a failed measurement shows its status (e.g. ``OOM``).
    """
    def cell(r, key, fmt):
        return fmt.format(float(r[key])) if r and r.get(key) not in (None, "") else (r or {}).get("status", "-")

    by = {(r["model"], r["prompts"], r["prompt_len"], r["chunk_tokens"] != "none"): r for r in rows}
    out = ["| model | prompts x G | prompt tokens | chunked prefill (s) | one forward (s) | chunked extra (GiB) | "
           "one forward extra (GiB) | prompt cache (GiB) | chunked call peak (GiB) | one-forward call peak (GiB) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    cases = sorted({k[:3] for k in by}, key=_case_order)
    for model, prompts, width in cases:
        chunked, whole = by.get((model, prompts, width, True)), by.get((model, prompts, width, False))
        g = (chunked or whole)["G"]
        out.append(f"| {MODEL_NAMES[model]} | {prompts} x {g} | {width} | {cell(chunked, 'prefill_s', '{:.2f}')} | "
                   f"{cell(whole, 'prefill_s', '{:.2f}')} | {cell(chunked, 'prefill_extra_gib', '{:.2f}')} | "
                   f"{cell(whole, 'prefill_extra_gib', '{:.2f}')} | {cell(chunked or whole, 'prompt_cache_gib', '{:.2f}')} | "
                   f"{cell(chunked, 'call_peak_gib', '{:.1f}')} | {cell(whole, 'call_peak_gib', '{:.1f}')} |")
    return "\n".join(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(Path(__file__).parent / "results"), help="the experiments' CSVs")
    parser.add_argument("--grid", default=str(Path(__file__).parents[1] / "benchmarks/results/generation_grid_h200.csv"),
                        help="the generation benchmark's grid")
    parser.add_argument("--since", default="2026-11-23T14", help="ISO date prefix of the split-K runs")
    args = parser.parse_args(argv)
    results = Path(args.results)
    print(decode_step_table(_read(results / "generation_roofline_h200.csv"), args.since))
    print()
    print(attention_table(_read(results / "decode_attention_h200.csv")))
    print()
    print(split_length_table(_read(results / "decode_attention_split_len_h200.csv")))
    print()
    print(prefill_table(_read(results / "prefill_h200.csv")))
    print()
    print(programmatic_launch_table(_read(results / "generation_programmatic_launch_h200.csv")))
    print()
    print(step_breakdown_table(_read(results / "decode_step_breakdown_h200.csv")))
    print()
    print(decode_step_table(_read(Path(args.grid)), ""))


if __name__ == "__main__":
    main()
