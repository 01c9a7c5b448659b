#!/usr/bin/env python
"""One SFT training step (forward, loss, backward, AdamW) of a real Qwen2.5 / Qwen3 architecture with random
weights, per head/loss choice: peak memory, step time, and the head's overhead over a "no head" step.

Variants (each measured in its own subprocess, so peaks do not leak between them):

- ``no_head``            the loss is mean(h^2) + mean(W^2) of the final hidden states and the head
                         weight: both get gradients, no logits exist. The baseline of the overheads.
- ``torchtune_chunked``  torchtune 0.6.1's own path (``full_finetune_single_device``):
                         ``model.set_num_output_chunks(8)`` + ``torchtune.modules.loss.CEWithChunkedOutputLoss``.
- ``torchtune_chunked_compiled`` the same loss compiled as torchtune's recipes do with ``compile: True``
                         (``torchtune.training.compile_loss``: the per-chunk upcast + cross-entropy).
- ``torchtune_plain``    full fp32-upcast logits + ``F.cross_entropy`` (``--plain``; OOMs at long shapes).
- ``logitless_chunked``  ``logitless.losses.CEWithChunkedOutputLoss`` through ``set_model_output``.
- ``logitless_fused``    ``logitless.losses.LinearCrossEntropyLoss(impl=--fused-impl)``.

Same model, sequence length, batch, activation checkpointing (on by default) and optimizer
(``torch.optim.AdamW``, fused on CUDA, bf16 parameters as torchtune's bf16 recipes) for all.
``--compile`` compiles every variant's layers (torchtune's per-layer ``compile_model``, the rest of
``compile: True``), so the no-head baseline is compiled too.

    python benchmarks/bench_sft.py --model qwen2_5_0_5b --batch 8 --seq 8192
    python benchmarks/bench_sft.py --model qwen2_5_7b --batch 4 --seq 4096 --plain
    python benchmarks/bench_sft.py --model qwen2_5_0_5b --seq 8192 --max-batch   # largest batch per variant
    python benchmarks/bench_sft.py --model qwen3_1_7b --batch 1 --seq 65536 --variants no_head,logitless_fused
    python benchmarks/bench_sft.py --model qwen2_5_7b --batch 1 --seq 32768 --compile \
        --variants no_head,torchtune_chunked_compiled,logitless_fused        # the SFT target
    python benchmarks/bench_sft.py --quick                                       # tiny model, seconds

Writes ``benchmarks/results/sft_<model>_<device>.csv`` (appends; one row per variant) and prints a table.
Needs only the torchtune wheel (no recipe files).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ["no_head", "torchtune_chunked", "torchtune_chunked_compiled", "logitless_chunked", "logitless_fused"]
MODELS = {
    "qwen2_5_0_5b": "torchtune.models.qwen2_5.qwen2_5_0_5b",
    "qwen2_5_1_5b": "torchtune.models.qwen2_5.qwen2_5_1_5b_instruct",
    "qwen2_5_3b": "torchtune.models.qwen2_5.qwen2_5_3b",
    "qwen2_5_7b": "torchtune.models.qwen2_5.qwen2_5_7b_instruct",
    "qwen3_1_7b": "logitless.models.qwen3_1_7b",
    "tiny": "logitless.models.qwen2_5_tiny",
}
RESULTS = Path(__file__).resolve().parent / "results"


def _build(model_name: str, device, dtype):
    from torchtune import training
    from torchtune.config._utils import _get_component_from_path

    with training.set_default_dtype(dtype), device:
        model = _get_component_from_path(MODELS[model_name])()
    return model


def _step_fn(variant: str, model, fused_impl: str, chunks: int):
    """Returns ``f(tokens, labels) -> loss`` for one variant (labels already shifted)."""
    import torch.nn.functional as F

    if variant in ("torchtune_chunked", "torchtune_chunked_compiled"):
        from torchtune import training
        from torchtune.modules.loss import CEWithChunkedOutputLoss as TTChunked

        model.set_num_output_chunks(chunks)
        loss_fn = TTChunked(num_output_chunks=chunks)
        if variant == "torchtune_chunked_compiled":
            loss_fn = training.compile_loss(loss_fn, verbose=False)
        return lambda t, l: loss_fn(model(t), l)
    if variant == "torchtune_plain":
        def plain(t, l):
            logits = model(t)
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), l.reshape(-1), ignore_index=-100)
        return plain
    if variant == "no_head":
        from logitless.modules import wrap_output_head

        wrap_output_head(model).set_output_mode("hidden")

        def trivial(t, l):
            h, w = model(t)
            return h.float().pow(2).mean() + w.float().pow(2).mean()
        return trivial
    from logitless.losses import CEWithChunkedOutputLoss, LinearCrossEntropyLoss

    loss_fn = (CEWithChunkedOutputLoss(num_output_chunks=chunks) if variant == "logitless_chunked"
               else LinearCrossEntropyLoss(impl=fused_impl))
    loss_fn.set_model_output(model)
    return lambda t, l: loss_fn(model(t), l)


def run_child(a) -> dict:
    """Measures one variant in this process; returns a result dict."""
    import torch
    from torchtune import modules, training

    device = torch.device(a.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    torch.manual_seed(0)
    model = _build(a.model, device, dtype)
    if a.ac:
        training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    if getattr(a, "compile", False):  # after activation checkpointing, as torchtune's recipes do
        training.compile_model(model, verbose=False)
    f = _step_fn(a.variant, model, a.fused_impl, a.chunks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    vocab = model.tok_embeddings.num_embeddings
    g = torch.Generator(device="cpu").manual_seed(1)
    tokens = torch.randint(0, vocab, (a.batch, a.seq), generator=g).to(device)
    labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], dim=1)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    times, losses = [], []
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    for i in range(a.warmup + a.steps):
        sync()
        t0 = time.perf_counter()
        loss = f(tokens, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    step = statistics.median(times)
    return {"status": "ok", "peak_gib": peak, "step_ms": 1e3 * step,
            "tokens_per_s": a.batch * a.seq / step, "loss": losses[-1]}


def _spawn(a, variant: str, batch: int) -> dict:
    cmd = [sys.executable, __file__, "--_child", variant, "--model", a.model, "--batch", str(batch),
           "--seq", str(a.seq), "--steps", str(a.steps), "--warmup", str(a.warmup), "--dtype", a.dtype,
           "--device", a.device, "--fused-impl", a.fused_impl, "--chunks", str(a.chunks)]
    if not a.ac:
        cmd.append("--no-ac")
    if a.compile:
        cmd.append("--compile")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    err = (p.stderr or "")[-2000:]
    status = "OOM" if "OutOfMemoryError" in err or "out of memory" in err else f"error (rc {p.returncode})"
    if status != "OOM":
        print(err, file=sys.stderr)
    return {"status": status, "peak_gib": float("nan"), "step_ms": float("nan"), "tokens_per_s": float("nan"),
            "loss": float("nan")}


def _max_batch(a, variant: str) -> int:
    """Largest batch (doubling, then bisection) that runs without OOM; 0 if none."""
    lo, hi = 0, 1
    while True:
        if _spawn(a, variant, hi)["status"] != "ok":
            break
        lo, hi = hi, hi * 2
        if hi > a.max_batch_limit:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _spawn(a, variant, mid)["status"] == "ok":
            lo = mid
        else:
            hi = mid
    return lo


def _add_columns(path: Path, fields) -> list:
    """The header to append rows under: ``fields`` plus any column the existing CSV has beyond them.
    An existing CSV lacking some of ``fields`` is rewritten under that header first (the new columns
    stay empty in its rows), so appended rows line up with their columns."""
    if not path.exists():
        return list(fields)
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        header = list(reader.fieldnames or [])
        old = list(reader)
    merged = list(fields) + [c for c in header if c not in fields]
    if header != merged:
        with open(path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=merged)
            w.writeheader()
            w.writerows(old)
    return merged


def append_rows(path: Path, fields, rows) -> None:
    """Appends ``rows`` (dicts; keys outside the header are dropped) to the CSV at ``path`` under
    :func:`_add_columns`'s header, writing the header first into a new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = _add_columns(path, fields)  # an older file gains the new columns first
    new_file = not path.exists()
    with open(path, "a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=header, extrasaction="ignore")
        if new_file:
            w.writeheader()
        w.writerows(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2_5_0_5b", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS + ['torchtune_plain']}")
    p.add_argument("--plain", action="store_true", help="also run torchtune_plain (full logits)")
    p.add_argument("--fused-impl", default="auto", help="impl of LinearCrossEntropyLoss")
    p.add_argument("--chunks", type=int, default=8, help="output chunks of the chunked losses")
    p.add_argument("--no-ac", dest="ac", action="store_false", help="disable activation checkpointing")
    p.add_argument("--compile", action="store_true",
                   help="compile every variant's layers (torchtune's compile_model, as compile: True)")
    p.add_argument("--max-batch", action="store_true", help="also search the largest batch per variant")
    p.add_argument("--max-batch-limit", type=int, default=256)
    p.add_argument("--quick", action="store_true", help="tiny model, batch 2, seq 256, 1 step")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per measurement")
    p.add_argument("--out", default=None, help="CSV path (default benchmarks/results/sft_<model>_<device>.csv)")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.quick:
        a.model, a.batch, a.seq, a.steps, a.warmup = "tiny", 2, 256, 1, 1
        if a.device == "cpu":
            a.dtype = "fp32"
    if a._child:
        a.variant = a._child
        print("RESULT " + json.dumps(run_child(a)), flush=True)
        return
    variants = [v for v in a.variants.split(",") if v]
    if a.plain and "torchtune_plain" not in variants:
        variants.append("torchtune_plain")
    import torch

    from logitless.settings import settings

    dev_name = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    head_gemm = settings.head_gemm  # LOGITLESS_HEAD_GEMM, inherited by every variant's process
    rows = []
    for v in variants:
        r = _spawn(a, v, a.batch)
        r.update(variant=v)
        if a.max_batch:
            r["max_batch"] = _max_batch(a, v)
        rows.append(r)
        print(f"{v:>18}: {r['status']:>6}  peak {r['peak_gib']:7.2f} GiB  step {r['step_ms']:8.1f} ms  "
              f"{r['tokens_per_s']:9.0f} tok/s" + (f"  max batch {r['max_batch']}" if a.max_batch else ""), flush=True)
    base = next((r for r in rows if r["variant"] == "no_head" and r["status"] == "ok"), None)
    for r in rows:
        r["head_mem_gib"] = r["peak_gib"] - base["peak_gib"] if base else float("nan")
        r["head_ms"] = r["step_ms"] - base["step_ms"] if base else float("nan")
    out = Path(a.out) if a.out else RESULTS / f"sft_{a.model}_{dev_name.replace(' ', '_')}.csv"
    fields = ["model", "batch", "seq", "tokens", "variant", "status", "peak_gib", "step_ms", "tokens_per_s",
              "head_mem_gib", "head_ms", "max_batch", "ac", "compile", "head_gemm", "dtype", "device", "torch", "date"]
    append_rows(out, fields, [{**r, "model": a.model, "batch": a.batch, "seq": a.seq, "tokens": a.batch * a.seq,
                               "ac": a.ac, "compile": a.compile, "head_gemm": head_gemm, "dtype": a.dtype,
                               "device": dev_name, "torch": torch.__version__,
                               "date": time.strftime("%Y-%m-%d %H:%M"), "max_batch": r.get("max_batch", "")}
                              for r in rows])
    print("\n| variant | peak GiB | step ms | head GiB | head ms |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['peak_gib']:.2f} | {r['step_ms']:.0f} | {r['head_mem_gib']:.2f} | {r['head_ms']:.0f} |")
    print(f"\nCSV: {out}")


if __name__ == "__main__":
    main()
