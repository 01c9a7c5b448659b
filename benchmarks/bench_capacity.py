#!/usr/bin/env python
"""The longest sequence one GPU trains, per loss: batch 1, activation checkpointing, a full AdamW step.

For each model (Qwen2.5-0.5B, 1.5B, 7B architectures with random weights, bf16, synthetic tokens: no
download) and each loss, the sequence length doubles from ``--min-tokens`` until a step does not fit
(``torch.OutOfMemoryError``, or a peak over ``--memory-limit-gib``), then, with ``--bisect``, bisects
between the last length that fit and the first that did not, to ``--resolution`` tokens. Each length
that fits records its peak memory and step time. Losses:

- ``torchtune_chunked``          torchtune 0.6.1's recipe path: ``model.set_num_output_chunks(8)`` and
                                 ``torchtune.modules.loss.CEWithChunkedOutputLoss``.
- ``torchtune_chunked_compiled`` the same loss through ``torchtune.training.compile_loss``, as its
                                 recipes run it with ``compile: True``.
- ``liger_fused``                Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` on the final hidden
                                 states and the head weight (skipped when liger-kernel is not installed).
- ``logitless_fused``            ``logitless.losses.LinearCrossEntropyLoss(impl=--impl)`` (Triton fused head).

One process builds each model once and reuses it for every loss and length (torchtune's losses run
first: the logitless wrapper changes what the model returns); an out-of-memory step is caught, its
memory freed, and the search goes on. ``--lora on`` trains LoRA adapters (rank 16 on q/k/v/o and the
MLP) instead of every weight; ``--lora auto`` measures full fine-tuning and repeats with LoRA the
losses that do not fit at ``--min-tokens``. ``--offload`` adds torchtune's activation offloading
(``enable_activation_offloading``: the checkpointed layer inputs go to CPU memory), applied around the
model's forward as torchtune's ``full_finetune_single_device`` applies it.

Attention grows quadratically: a 1.5B step at 256k tokens takes tens of seconds. The search is
bounded: ``--max-tokens``; ``--trial-cap-s`` skips a length whose predicted time (the last step's,
scaled by the square of the length ratio) exceeds it; ``--max-minutes`` stops starting trials once the
run's budget would be passed. A skipped length is recorded as such, never as a fit or a miss.

    python benchmarks/bench_capacity.py --models 1.5b --max-tokens 262144 --max-minutes 8
    python benchmarks/bench_capacity.py --models 0.5b,7b --lora auto --max-tokens 262144 --max-minutes 8
    python benchmarks/bench_capacity.py --models 1.5b --losses logitless_fused --offload \\
        --min-tokens 262144 --max-tokens 524288 --warmup 0 --max-minutes 8
    python benchmarks/bench_capacity.py --models 1.5b --losses torchtune_chunked --bisect --min-tokens 65536 \\
        --max-tokens 131072                                   # bisect where the doubling stopped
    python benchmarks/bench_capacity.py --quick                # tiny model on CPU, simulated memory limit
    python benchmarks/bench_capacity.py --plot-csv benchmarks/results/capacity_nvidia_h100_80gb_hbm3.csv

Appends one row per trial to ``benchmarks/results/capacity_<gpu>.csv`` (GPU name and memory, torch,
triton, torchtune and liger versions, date in every row), prints the longest fitting length per model
and loss, and with ``--plot`` draws peak memory against length (``capacity_<gpu>.png``, matplotlib;
``--plot-csv`` draws every run of a CSV).
"""

import argparse
import csv
import datetime
import gc
import importlib.metadata
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sft import append_rows  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = {  # name: (full builder, LoRA builder); torchtune's Qwen2.5 architectures, our Qwen3, the bundled tiny one
    "0.5b": ("torchtune.models.qwen2_5.qwen2_5_0_5b", "torchtune.models.qwen2_5.lora_qwen2_5_0_5b"),
    "1.5b": ("torchtune.models.qwen2_5.qwen2_5_1_5b_instruct", "torchtune.models.qwen2_5.lora_qwen2_5_1_5b_instruct"),
    "7b": ("torchtune.models.qwen2_5.qwen2_5_7b_instruct", "torchtune.models.qwen2_5.lora_qwen2_5_7b_instruct"),
    "qwen3_1_7b": ("logitless.models.qwen3_1_7b", "logitless.models.lora_qwen3_1_7b"),
    "tiny": ("logitless.models.qwen2_5_tiny", "logitless.models.lora_qwen2_5_tiny"),
}
LORA_ARGS = dict(lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                 lora_rank=16, lora_alpha=32)
# torchtune's losses first: the logitless wrapper (liger_fused, logitless_fused) changes what the model returns
LOSSES = ("torchtune_chunked", "torchtune_chunked_compiled", "liger_fused", "logitless_fused")
CHUNKS = 8  # torchtune's recipes: model.set_num_output_chunks(8)
FIELDS = ["model", "mode", "loss", "offload", "seq_len", "status", "peak_gib", "step_s", "tokens_per_s",
          "longest", "gpu", "gpu_memory_gib", "memory_limit_gib", "torch", "triton", "torchtune", "liger",
          "date"]


# ------------------------------------------------------------------------------------------- search
def search_longest(fits: Callable[[int], str], *, start: int, max_tokens: int, resolution: int,
                   bisect: bool) -> int:
    """The longest length that fits: doubling from ``start``, then (``bisect``) bisection to ``resolution``.

    Args:
        fits (Callable[[int], str]): runs one trial at a length; ``"ok"`` (fits), ``"OOM"`` (does not),
            or anything else (not measured: the search stops where it is).
        start (int): the first length (a multiple of ``resolution``).
        max_tokens (int): no length above it is tried; it is tried itself when doubling passes it.
        resolution (int): bisection stops when the gap between fit and miss is this or less; every
            length tried is a multiple of it.
        bisect (bool): bisect after the doubling (False: the last doubling that fit).

    Returns:
        int: the longest length that fit (0: not even ``start``).

    Example:
        >>> search_longest(lambda n: "ok" if n <= 40 else "OOM", start=8, max_tokens=1024, resolution=8,
        ...                bisect=True)
        40
    """
    if start % resolution or start < resolution:
        raise ValueError(f"--min-tokens {start} must be a positive multiple of --resolution {resolution}")
    best, length, miss = 0, start, None
    while length <= max_tokens:
        status = fits(length)
        if status != "ok":
            miss = length if status == "OOM" else None
            break
        best = length
        if length == max_tokens:
            return best
        length = min(2 * length, max_tokens)
    if not bisect or miss is None or best == 0:
        return best
    while miss - best > resolution:
        mid = (best + miss) // 2 // resolution * resolution
        status = fits(mid)
        if status == "ok":
            best = mid
        elif status == "OOM":
            miss = mid
        else:
            break
    return best


# ------------------------------------------------------------------------------------------- memory
class CudaMeter:
    """Peak allocated memory of the current CUDA device."""

    def __init__(self, device):
        import torch

        self.torch, self.device = torch, device

    def reset(self, tokens: int) -> None:
        self.torch.cuda.empty_cache()
        self.torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float:
        return self.torch.cuda.max_memory_allocated(self.device) / 2**30

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.device)


class SimulatedMeter:
    """A peak of ``static_gib + gib_per_token x tokens``: the search and the bookkeeping on a CPU, where
    torch measures no peak (tests, ``--quick``)."""

    def __init__(self, static_gib: float, gib_per_token: float):
        self.static_gib, self.gib_per_token, self.tokens = static_gib, gib_per_token, 0

    def reset(self, tokens: int) -> None:
        self.tokens = tokens

    def peak_gib(self) -> float:
        return self.static_gib + self.gib_per_token * self.tokens

    def sync(self) -> None:
        pass


# ------------------------------------------------------------------------------------------- model
def allow_length(model, max_seq_len: int) -> None:
    """Lets a torchtune decoder take ``max_seq_len`` tokens: torchtune's Qwen2.5 builders fix 32768, and
    their rotary tables end there. The tables are rebuilt longer (the same frequencies). Every torchtune
    rotary class (``RotaryPositionalEmbeddings``, Qwen2's, Llama 3.1's scaled one) has ``build_rope_cache``
    but they share no base class, so they are found by that method."""
    if max_seq_len <= model.max_seq_len:
        return
    model.max_seq_len = max_seq_len
    for module in model.modules():
        if callable(getattr(module, "build_rope_cache", None)):
            module.max_seq_len = max_seq_len
            module.build_rope_cache(max_seq_len)


def build_model(name: str, *, lora: bool, max_seq_len: int, device, dtype):
    """The model ``name`` with random weights in ``dtype`` on ``device``, activation checkpointing on,
    LoRA adapters trainable only when ``lora``."""
    import torch
    from torchtune import modules, training
    from torchtune.config._utils import _get_component_from_path
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    torch.manual_seed(0)
    builder = _get_component_from_path(MODELS[name][1 if lora else 0])
    with training.set_default_dtype(dtype), device:
        model = builder(**LORA_ARGS) if lora else builder()
    allow_length(model, max_seq_len)
    if lora:
        set_trainable_params(model, get_adapter_params(model))
    training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    return model


@dataclass
class LossPath:
    """How one loss runs a step: ``forward(tokens)`` is the model's part (under activation offloading
    when on), ``loss(outputs, labels)`` the rest."""

    forward: Callable
    loss: Callable


def loss_path(name: str, model, impl: str) -> LossPath:
    """Sets ``model`` up for the loss ``name`` and returns its :class:`LossPath` (labels already shifted)."""
    if name in ("torchtune_chunked", "torchtune_chunked_compiled"):
        from torchtune import training
        from torchtune.modules.loss import CEWithChunkedOutputLoss

        model.set_num_output_chunks(CHUNKS)
        fn = CEWithChunkedOutputLoss(num_output_chunks=CHUNKS)
        if name == "torchtune_chunked_compiled":
            fn = training.compile_loss(fn, verbose=False)
        return LossPath(model, fn)
    if name == "liger_fused":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        from logitless.modules import wrap_output_head

        wrap_output_head(model).set_output_mode("hidden")
        fn = LigerFusedLinearCrossEntropyLoss()
        return LossPath(model, lambda out, labels: fn(out.weight, out.hidden.reshape(-1, out.hidden.shape[-1]),
                                                       labels.reshape(-1)))
    if name == "logitless_fused":
        from logitless.losses import LinearCrossEntropyLoss

        fn = LinearCrossEntropyLoss(impl=impl)
        fn.set_model_output(model)
        return LossPath(model, fn)
    raise ValueError(f"--losses: unknown loss {name!r}; expected some of {LOSSES}")


def liger_version() -> Optional[str]:
    try:
        return importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------------------------------- trials
@dataclass
class Budget:
    """The run's deadline and the per-trial cap, with the last step time of each search to predict the next."""

    deadline: float
    trial_cap_s: float
    last: Dict[tuple, tuple] = field(default_factory=dict)  # key -> (tokens, seconds per step)

    def predicted_s(self, key: tuple, tokens: int) -> float:
        if key not in self.last:
            return 0.0
        n, seconds = self.last[key]
        return seconds * (tokens / n) ** 2

    def refuses(self, key: tuple, tokens: int, steps: int) -> Optional[str]:
        per_step = self.predicted_s(key, tokens)
        if per_step > self.trial_cap_s:
            return f"skipped: predicted {per_step:.0f} s a step > --trial-cap-s {self.trial_cap_s:.0f}"
        if time.time() + per_step * steps > self.deadline:
            return "skipped: --max-minutes budget"
        return None


def run_trial(model, optimizer, path: LossPath, *, tokens: int, vocab: int, meter, device, warmup: int,
              steps: int, offload_ctx, memory_limit_gib: Optional[float]) -> dict:
    """``warmup + steps`` full steps at ``tokens`` tokens (at least one); out-of-memory is caught and freed.

    Returns:
        dict: ``status`` ("ok" or "OOM"), ``peak_gib``, ``step_s`` (median of the timed steps, or the
        first step's time without timed steps).
    """
    import torch

    meter.reset(tokens)
    g = torch.Generator(device="cpu").manual_seed(tokens)
    times = []
    oom = False
    try:
        ids = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        for _ in range(max(1, warmup + steps)):
            meter.sync()
            t0 = time.perf_counter()
            with offload_ctx:
                outputs = path.forward(ids)
            loss = path.loss(outputs, labels)
            del outputs
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss
            meter.sync()
            times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError:
        oom = True  # handled below, outside the except block, so its traceback (and tensors) are gone
    if oom:
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"status": "OOM", "peak_gib": float("nan"), "step_s": float("nan")}
    peak = meter.peak_gib()
    if memory_limit_gib is not None and peak > memory_limit_gib:
        return {"status": "OOM", "peak_gib": peak, "step_s": float("nan")}
    timed = times[warmup:] or times
    return {"status": "ok", "peak_gib": peak, "step_s": statistics.median(timed)}


def measure_model(a, name: str, losses: Sequence[str], *, lora: bool, meter, device, dtype, budget: Budget,
                  meta: dict, log: Callable[[str], None]) -> List[dict]:
    """Every loss's search on one model, built once; returns one row per trial."""
    import torch

    from torchtune import training

    model = build_model(name, lora=lora, max_seq_len=a.max_tokens, device=device, dtype=dtype)
    vocab = model.tok_embeddings.num_embeddings
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5,
                                  fused=device.type == "cuda")
    offload_ctx = training.get_act_offloading_ctx_manager(model, a.offload)
    mode = "lora" if lora else "full"
    rows: List[dict] = []
    for loss in losses:
        path = loss_path(loss, model, a.impl)
        key = (name, mode, loss)

        def fits(tokens: int) -> str:
            refusal = budget.refuses(key, tokens, max(1, a.warmup + a.steps))
            result = ({"status": refusal, "peak_gib": float("nan"), "step_s": float("nan")} if refusal else
                      run_trial(model, optimizer, path, tokens=tokens, vocab=vocab, meter=meter, device=device,
                                warmup=a.warmup, steps=a.steps, offload_ctx=offload_ctx,
                                memory_limit_gib=a.memory_limit_gib))
            if result["status"] == "ok":
                budget.last[key] = (tokens, result["step_s"])
            rows.append({**meta, "model": name, "mode": mode, "loss": loss, "offload": a.offload, "seq_len": tokens,
                         **result, "tokens_per_s": tokens / result["step_s"] if result["status"] == "ok" else
                         float("nan"), "longest": False})
            log(f"{name:>5} {mode:<4} {loss:<27} {tokens:>8} tokens: {result['status']:<6} "
                f"peak {result['peak_gib']:7.2f} GiB  step {result['step_s']:8.3f} s")
            return result["status"]

        best = search_longest(fits, start=a.min_tokens, max_tokens=a.max_tokens, resolution=a.resolution,
                              bisect=a.bisect)
        for row in rows:
            if row["loss"] == loss and row["mode"] == mode and row["seq_len"] == best and row["status"] == "ok":
                row["longest"] = True
    del model, optimizer, offload_ctx
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def run_metadata(device, memory_limit_gib: Optional[float]) -> dict:
    import torch
    import torchtune

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu, memory = props.name, props.total_memory / 2**30
    else:
        gpu, memory = "cpu", float("nan")
    return {"gpu": gpu, "gpu_memory_gib": memory, "memory_limit_gib": memory_limit_gib, "torch": torch.__version__,
            "triton": triton_version, "torchtune": torchtune.__version__, "liger": liger_version(),
            "date": datetime.date.today().isoformat()}


def summary(rows: List[dict]) -> List[str]:
    """One line per (model, mode, loss): the longest length that fit, its peak and step time."""
    lines = [f"{'model':>5} {'mode':<4} {'loss':<27} {'offload':<7} {'longest':>8} {'peak GiB':>9} {'step s':>8}  "
             f"first miss"]
    keys = list(dict.fromkeys((r["model"], r["mode"], r["loss"], r["offload"]) for r in rows))
    for key in keys:
        mine = [r for r in rows if (r["model"], r["mode"], r["loss"], r["offload"]) == key]
        best = next((r for r in mine if r["longest"]), None)
        misses = sorted(r["seq_len"] for r in mine if r["status"] == "OOM")
        skipped = [r for r in mine if r["status"].startswith("skipped")]
        miss = str(misses[0]) if misses else (skipped[0]["status"] if skipped else "none up to --max-tokens")
        if best is None:
            lines.append(f"{key[0]:>5} {key[1]:<4} {key[2]:<27} {str(key[3]):<7} {'< ' + str(mine[0]['seq_len']):>8} "
                         f"{'':>9} {'':>8}  {miss}")
        else:
            lines.append(f"{key[0]:>5} {key[1]:<4} {key[2]:<27} {str(key[3]):<7} {best['seq_len']:>8} "
                         f"{best['peak_gib']:9.2f} {best['step_s']:8.3f}  {miss}")
    return lines


def read_rows(path: Path) -> List[dict]:
    """The rows of a capacity CSV, with numbers and flags parsed back."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    for r in rows:
        r["seq_len"] = int(r["seq_len"])
        for k in ("peak_gib", "step_s", "gpu_memory_gib"):
            r[k] = float(r[k]) if r[k] not in ("", None) else float("nan")
        r["memory_limit_gib"] = float(r["memory_limit_gib"]) if r["memory_limit_gib"] else None
        r["offload"] = r["offload"] == "True"
    return rows


def plot(rows: List[dict], path: Path) -> None:
    """Peak memory against sequence length, one panel per model, one line per loss and mode (with
    activation offloading: dashed); needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(max(7, 5 * len(models)), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for loss, mode, offload in dict.fromkeys((r["loss"], r["mode"], r["offload"]) for r in rows
                                                  if r["model"] == model):
            ok = sorted({r["seq_len"]: r["peak_gib"] for r in rows if r["status"] == "ok" and r["model"] == model
                         and (r["loss"], r["mode"], r["offload"]) == (loss, mode, offload)}.items())
            if ok:
                ax.plot([n / 1024 for n, _ in ok], [p for _, p in ok], marker="o", linestyle="--" if offload else "-",
                        label=f"{loss} ({mode}{', offload' if offload else ''})")
        memory = rows[0]["memory_limit_gib"] or rows[0]["gpu_memory_gib"]
        if memory == memory:  # not NaN
            ax.axhline(memory, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (k tokens), batch 1")
        ax.set_ylabel("peak allocated (GiB)")
        ax.set_title(f"Qwen2.5-{model}" if model != "tiny" else "tiny")
        ax.legend(fontsize=7)
    fig.suptitle(f"Peak memory of one training step (batch 1, activation checkpointing)\n{rows[0]['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------------------------------------- main
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="0.5b,1.5b,7b", help=f"comma-separated, of {sorted(MODELS)}")
    p.add_argument("--losses", default=",".join(LOSSES), help=f"comma-separated, of {LOSSES} (or 'all')")
    p.add_argument("--min-tokens", type=int, default=8192, help="the first length tried")
    p.add_argument("--max-tokens", type=int, default=262144, help="no longer length is tried")
    p.add_argument("--resolution", type=int, default=8192, help="bisection stops at this gap")
    p.add_argument("--bisect", action="store_true", help="bisect after the doubling (off: doubling only)")
    p.add_argument("--lora", choices=("off", "on", "auto"), default="off",
                   help="auto: repeat with LoRA the losses whose full fine-tuning does not fit at --min-tokens")
    p.add_argument("--offload", action="store_true", help="torchtune's activation offloading (CUDA only)")
    p.add_argument("--impl", default="triton", help="logitless_fused's impl (triton on a GPU)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per length (the first also decides the fit)")
    p.add_argument("--steps", type=int, default=1, help="timed steps per length (0: time the first step)")
    p.add_argument("--max-minutes", type=float, default=8.0, help="start no trial that would end after this")
    p.add_argument("--trial-cap-s", type=float, default=120.0, help="skip a length predicted slower per step")
    p.add_argument("--memory-limit-gib", type=float, default=None,
                   help="count a step peaking above this as not fitting (emulates a smaller GPU)")
    p.add_argument("--device", default=None, help="default: cuda when available")
    p.add_argument("--out", type=Path, default=None, help="CSV (default benchmarks/results/capacity_<gpu>.csv)")
    p.add_argument("--plot", action="store_true", help="also draw this run's rows (the CSV's name with .png)")
    p.add_argument("--plot-csv", type=Path, default=None,
                   help="only draw every row of this capacity CSV (its name with .png); no GPU work")
    p.add_argument("--quick", action="store_true",
                   help="tiny model on CPU, lengths 8-64, a simulated 1 MiB per token under --memory-limit-gib")
    a = p.parse_args(argv)
    if a.quick:
        a.models, a.losses, a.device, a.impl = "tiny", "torchtune_chunked,logitless_fused", "cpu", "chunked"
        a.min_tokens, a.max_tokens, a.resolution, a.bisect, a.warmup, a.steps = 8, 64, 8, True, 0, 1
        a.memory_limit_gib = 40 / 1024 if a.memory_limit_gib is None else a.memory_limit_gib
    a.models = [m for m in a.models.split(",") if m]
    a.losses = list(LOSSES) if a.losses == "all" else [x for x in a.losses.split(",") if x]
    for m in a.models:
        if m not in MODELS:
            p.error(f"--models: unknown model {m!r}; expected some of {sorted(MODELS)}")
    for x in a.losses:
        if x not in LOSSES:
            p.error(f"--losses: unknown loss {x!r}; expected some of {LOSSES}")
    if a.max_tokens < a.min_tokens:
        p.error(f"--max-tokens {a.max_tokens} is below --min-tokens {a.min_tokens}")
    if a.min_tokens % a.resolution:
        p.error(f"--min-tokens {a.min_tokens} must be a multiple of --resolution {a.resolution}")
    a.losses = [x for x in LOSSES if x in a.losses]  # torchtune's first (see LOSSES)
    return a


def main(argv: Optional[Sequence[str]] = None, *, meter=None, log: Callable[[str], None] = print) -> List[dict]:
    """Runs the searches; returns the CSV rows. ``meter`` replaces the CUDA peak meter (tests)."""
    import torch

    a = parse_args(argv)
    if a.plot_csv is not None:
        plot(read_rows(a.plot_csv), a.plot_csv.with_suffix(".png"))
        log(f"plot: {a.plot_csv.with_suffix('.png')}")
        return []
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if a.offload and device.type != "cuda":
        raise SystemExit("--offload: torchtune's activation offloading needs a CUDA device")
    if "liger_fused" in a.losses and liger_version() is None:
        log("liger-kernel is not installed: liger_fused skipped")
        a.losses.remove("liger_fused")
    if meter is None:
        meter = (CudaMeter(device) if device.type == "cuda" else
                 SimulatedMeter(static_gib=0.0, gib_per_token=1 / 1024))  # --quick: 1 MiB a token
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    budget = Budget(deadline=time.time() + 60 * a.max_minutes, trial_cap_s=a.trial_cap_s)
    meta = run_metadata(device, a.memory_limit_gib)
    rows: List[dict] = []
    for name in a.models:
        if a.lora in ("off", "auto"):
            rows += measure_model(a, name, a.losses, lora=False, meter=meter, device=device, dtype=dtype,
                                  budget=budget, meta=meta, log=log)
        # auto: the losses whose full fine-tuning ran out of memory at the first length
        missing = [x for x in a.losses if any(r["model"] == name and r["loss"] == x and r["status"] == "OOM"
                                              and r["seq_len"] == a.min_tokens for r in rows)]
        lora_losses = a.losses if a.lora == "on" else (missing if a.lora == "auto" else [])
        if lora_losses:
            rows += measure_model(a, name, lora_losses, lora=True, meter=meter, device=device, dtype=dtype,
                                  budget=budget, meta=meta, log=log)
    out = a.out or RESULTS / f"capacity_{meta['gpu'].replace(' ', '_').lower()}.csv"
    if rows:
        append_rows(out, FIELDS, rows)
        log(f"wrote {len(rows)} rows to {out}")
        for line in summary(rows):
            log(line)
        if a.plot:
            plot(rows, out.with_suffix(".png"))
            log(f"plot: {out.with_suffix('.png')}")
    return rows


if __name__ == "__main__":
    main()
