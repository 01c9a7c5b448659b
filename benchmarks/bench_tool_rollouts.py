"""Multi-turn (tool) rollouts against single-turn rollouts of the same length, and the update's memory.

For each model (random bf16 weights), ``--rows`` rows (``rows / G`` prompts x G) sample trajectories
of ``--turns`` model turns with each multi-turn sampler: the eager reference
(:func:`logitless.generation.tools.eager.generate_turns`) and the compiled one
(:class:`logitless.generation.tools.compiled.CompiledTurnSampler`, fused projections, as
``configs/qwen_tools_grpo.yaml`` builds it). Between turns each row's environment sleeps
``--latency-ms`` (a tool's latency, on its own thread while the other rows decode) and answers with
``--tool-tokens`` tokens, which the sampler feeds into the row's KV cache (one token per decode step,
or in one forward of the row from ``--segment-prefill-tokens``: one multi-turn run per value given,
``auto`` being each sampler's default). A turn ends at a stop
token: a set holding about ``1 / --turn-tokens`` of a near-uniform distribution, so turns are
geometric with that mean. The prompt and the tool answers are fixed token ids (no chat template,
which costs host time only): what is measured is the sampler.

Then, at the mean total completion length ``L`` the trajectories reached (their turns and the
appended tool tokens), the single-turn samplers decode ``L`` tokens per row without stopping: the
eager reference (``generate``) and the compiled sampler (``CompiledSampler``, fused projections).
Reported per row of the CSV: wall seconds, completion tokens per second (sampled and appended),
sampled tokens per second, mean turns, the longest row's length, tool seconds per row, the decode
steps and the wall time per step (compiled turn sampler and single-turn samplers), and for a
multi-turn rollout with
latency whether it equals the same sampler's rollout with instant tools (``same_as_instant``: the
fraction of rows whose tokens are identical; the draws are keyed by row and position, so a tool's
latency moves a row in time, not its tokens).

``--update``: one GRPO update (``GRPOLoss``, the fused head, prompt once per group, micro-batches of
one group) on the multi-turn rollout (tool tokens masked out of the loss) and on the single-turn
rollout of the same length: its time and peak allocated memory, next to the bytes that ``[N, T, V]``
bf16 logits of the completions would take (which the fused head never holds).

Example (H100 / H200):
    PYTHONPATH=components python benchmarks/bench_tool_rollouts.py --models 0.5b,1.5b --rows 64 --turns 4 \\
        --latency-ms 0,50 --update
    PYTHONPATH=components python benchmarks/bench_tool_rollouts.py --models 0.5b --tool-tokens 1024 \
        --turn-samplers compiled_turns --single-samplers compiled --segment-prefill-tokens none,128
    PYTHONPATH=components python benchmarks/bench_tool_rollouts.py --models tiny --device cpu --rows 8 \\
        --turn-tokens 4 --tool-tokens 3 --prompt-len 8 --no-compile   # CPU smoke test
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generation import MODELS, _sync, _table, build_model, save_rows  # noqa: E402

FIELDS = ["date", "gpu", "torch", "triton", "torchtune", "model", "what", "sampler", "rows", "G", "prompt_len",
          "turns", "turn_tokens", "tool_tokens", "segment_prefill_tokens", "latency_ms", "mean_turns", "mean_len",
          "max_len", "sampled", "appended", "seconds", "tokens_per_s", "sampled_per_s", "tool_s_per_row", "same_as_instant",
          "decode_steps", "ms_per_step", "update_s", "peak_gib", "logits_gib", "status"]
TABLE = ["model", "what", "sampler", "segment_prefill_tokens", "latency_ms", "mean_turns", "mean_len", "max_len", "seconds", "tokens_per_s",
         "sampled_per_s", "same_as_instant", "decode_steps", "ms_per_step", "update_s", "peak_gib", "logits_gib",
         "status"]
GROUP = 8


class FixedChat:
    """The session's chat with fixed token ids instead of a template: every prompt is ``prompt`` and
    every tool turn appends ``answer``; turns are not parsed (the environment decides)."""

    def __init__(self, prompt, answer, end_of_turn_id):
        self.prompt_ids, self.answer, self.end_of_turn_id = list(prompt), list(answer), end_of_turn_id

    def prompt(self, messages):
        return self.prompt_ids, ""

    def parse(self, turn_ids, stop_ids=()):
        from logitless.generation.tools import ParsedTurn

        return ParsedTurn("")

    def continuation(self, history, new_messages):
        return self.answer, ""


class LatencyEnvironment:
    """A tool that answers after ``latency_s`` seconds, never done (``max_turns`` ends the trajectory)."""

    def __init__(self, latency_s):
        self.latency_s = latency_s

    def reset(self, row):
        return [{"role": "user", "content": "task"}]

    def step(self, messages):
        if self.latency_s:
            time.sleep(self.latency_s)
        return [{"role": "tool", "content": "answer"}], False, {}


def turn_stop_tokens(vocab, turn_tokens, seed=0):
    """Ids holding about ``1 / turn_tokens`` of a near-uniform distribution: turns of that mean length."""
    count = max(1, round(vocab / turn_tokens))
    perm = torch.randperm(vocab - 1, generator=torch.Generator().manual_seed(seed)) + 1
    return perm[:count].tolist()


def multi_turn(model, sampler, args, latency_ms, seed, segment_prefill="auto"):
    """(seconds, rollout) of one multi-turn rollout; tool answers of ``segment_prefill`` tokens or more
    go in with one forward of their row (None: fed one token per step; "auto": the sampler's default)."""
    from logitless.generation.tools.session import TurnSession
    from logitless.generation import prompt_generators

    vocab = model.tok_embeddings.num_embeddings
    rng = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, vocab, (args.prompt_len,), generator=rng).tolist()
    answer = torch.randint(1, vocab, (args.tool_tokens,), generator=rng).tolist()
    stops = turn_stop_tokens(vocab, args.turn_tokens, seed)
    chat = FixedChat(prompt, answer, stops[0])
    prompts = args.rows // GROUP
    session = TurnSession(chat, lambda: LatencyEnvironment(latency_ms / 1000), [{}] * prompts,
                          num_generations=GROUP, max_turns=args.turns, stop_ids=stops)
    budget = args.turns * (args.turn_tokens * 4 + args.tool_tokens)  # turns rarely run out of room
    device = next(model.parameters()).device
    _sync(device)
    t0 = time.perf_counter()
    rollout = sampler(model, session, max_new_tokens=budget, stop_tokens=stops, pad_id=0, temperature=1.0,
                      generator=prompt_generators(seed, 0, range(prompts), device),
                      segment_prefill_tokens=segment_prefill)
    _sync(device)
    return time.perf_counter() - t0, rollout


def single_turn(model, sampler, args, length, seed):
    """(seconds, rollout) of ``length`` tokens per row without a stop."""
    from logitless.generation import prompt_generators

    vocab = model.tok_embeddings.num_embeddings
    prompts = [torch.randint(1, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
               ] * (args.rows // GROUP)
    device = next(model.parameters()).device
    _sync(device)
    t0 = time.perf_counter()
    rollout = sampler(model, prompts, max_new_tokens=length, stop_tokens=[vocab], pad_id=0, num_generations=GROUP,
                      temperature=1.0, generator=prompt_generators(seed, 0, range(len(prompts)), device))
    _sync(device)
    return time.perf_counter() - t0, rollout


def update(model, rollout, device):
    """(seconds, peak GiB, logits GiB) of one GRPO update on ``rollout`` (prompt once per group)."""
    from logitless.losses.grpo import GRPOLoss
    from logitless.rl.shared_batch import training_batch
    from logitless.rl.update import grpo_update

    model.requires_grad_(True).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    loss_fn = GRPOLoss(impl="auto")
    batch = training_batch(rollout, prompt_sharing=True)
    advantages = torch.linspace(-1, 1, len(batch), device=device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t0 = time.perf_counter()
    grpo_update(model, loss_fn, optimizer, batch, advantages, micro_batch_size=GROUP)
    _sync(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    n, t = rollout.completion_tokens.shape
    logits = n * t * model.tok_embeddings.num_embeddings * 2 / 2**30
    model.requires_grad_(False).eval()
    optimizer.zero_grad(set_to_none=True)
    return seconds, peak, logits


def _steps(steps, seconds):
    """The decode steps of a rollout (every row in each; 0: not known) and the wall time per step."""
    return dict(decode_steps=steps or "", ms_per_step=round(1000 * seconds / steps, 3) if steps else "")


def bench_model(name, args, device):
    from logitless.generation import CompiledSampler, generate
    from logitless.generation.tools.compiled import CompiledTurnSampler
    from logitless.generation.tools.eager import generate_turns

    model = build_model(name, device)
    base = dict(model=name, rows=args.rows, G=GROUP, prompt_len=args.prompt_len, turns=args.turns,
                turn_tokens=args.turn_tokens, tool_tokens=args.tool_tokens, status="ok")
    rows = []
    turn_samplers = {}
    if "eager_turns" in args.turn_samplers:
        turn_samplers["eager_turns"] = generate_turns
    if "compiled_turns" in args.turn_samplers and not args.no_compiled:
        turn_samplers["compiled_turns"] = CompiledTurnSampler(compile=not args.no_compile, fused_projections="shared")
    lengths, rollouts = [], {}
    runs = [(label, prefill) for label in turn_samplers for prefill in args.segment_prefill_tokens]
    for label, prefill in runs:
        sampler = turn_samplers[label]
        multi_turn(model, sampler, args, 0, seed=0, segment_prefill=prefill)  # warm-up: compile, allocator
        instant = None
        for latency in args.latency_ms:
            seconds, rollout = multi_turn(model, sampler, args, latency, seed=1, segment_prefill=prefill)
            real = int(rollout.completion_mask.sum())
            sampled = int(rollout.loss_mask.sum())
            trajectories = rollout.trajectories
            lengths.append(real / args.rows)
            rollouts[(label, prefill, latency)] = rollout
            if instant is None:
                instant = rollout
            same = (rollout.completion_tokens.shape == instant.completion_tokens.shape and
                    (rollout.completion_tokens == instant.completion_tokens).all(1).float().mean().item())
            rows.append(dict(base, what="multi_turn", sampler=label, latency_ms=latency,
                             segment_prefill_tokens="" if prefill is None else prefill,
                             mean_turns=round(sum(t.turns for t in trajectories) / len(trajectories), 2),
                             mean_len=round(real / args.rows, 1),
                             max_len=int(rollout.completion_mask.sum(1).max()), sampled=sampled, appended=real - sampled,
                             seconds=round(seconds, 3), tokens_per_s=round(real / seconds, 1),
                             sampled_per_s=round(sampled / seconds, 1), same_as_instant=round(float(same), 3),
                             **_steps(getattr(sampler, "last_steps", 0), seconds),
                             tool_s_per_row=round(sum(t.tool_seconds for t in trajectories) / len(trajectories), 3)))
    length = max(1, round(sum(lengths) / len(lengths)))
    samplers = {}
    if "eager" in args.single_samplers:
        samplers["eager"] = generate
    if "compiled" in args.single_samplers and not args.no_compiled:
        samplers["compiled"] = CompiledSampler(compile=not args.no_compile, fused_projections="shared")
    for label, sampler in samplers.items():
        single_turn(model, sampler, args, length, seed=0)  # compile / capture
        seconds, rollout = single_turn(model, sampler, args, length, seed=1)
        real = int(rollout.completion_mask.sum())
        rows.append(dict(base, what="single_turn", sampler=label, latency_ms="", mean_turns=1,
                         **_steps(rollout.completion_tokens.shape[1], seconds),
                         mean_len=round(real / args.rows, 1), max_len=int(rollout.completion_mask.sum(1).max()),
                         sampled=real, appended=0, seconds=round(seconds, 3),
                         tokens_per_s=round(real / seconds, 1), sampled_per_s=round(real / seconds, 1)))
        rollouts[label] = rollout
    if args.update:
        for row in rows:
            key = row["sampler"]
            if row["what"] == "multi_turn":
                key = (row["sampler"], row["segment_prefill_tokens"] if row["segment_prefill_tokens"] != "" else None,
                       row["latency_ms"])
            if row["what"] == "single_turn" and row["sampler"] == "compiled" and "eager" in samplers:
                # the same rollout as eager's
                continue
            seconds, peak, logits = update(model, rollouts[key], device)
            row.update(update_s=round(seconds, 3), peak_gib=round(peak, 2), logits_gib=round(logits, 4))
    del model
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="0.5b,1.5b", help=f"comma list of {sorted(MODELS)}")
    ap.add_argument("--rows", type=int, default=64, help=f"rows per rollout (prompts x G={GROUP})")
    ap.add_argument("--turns", type=int, default=4, help="model turns per trajectory")
    ap.add_argument("--turn-tokens", type=int, default=128, help="mean tokens of a model turn")
    ap.add_argument("--tool-tokens", type=int, default=32, help="tokens of each tool answer")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--latency-ms", default="0,50", help="comma list of tool latencies")
    ap.add_argument("--segment-prefill-tokens", default="auto",
                    help="comma list: a multi-turn run per value; tool answers this long or longer go in with one "
                         "forward of their row ('none': fed one token per step; 'auto': each sampler's default, "
                         "128 eager, 1024 compiled)")
    ap.add_argument("--turn-samplers", default="eager_turns,compiled_turns",
                    help="comma list of the multi-turn samplers to run: eager_turns, compiled_turns")
    ap.add_argument("--single-samplers", default="eager,compiled",
                    help="comma list of the single-turn samplers to run at the same mean length: eager, compiled "
                         "(empty: none)")
    ap.add_argument("--update", action="store_true", help="also time one GRPO update and its peak memory")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-compile", action="store_true", help="the compiled samplers without torch.compile")
    ap.add_argument("--no-compiled", action="store_true", help="skip the compiled samplers (multi- and single-turn)")
    ap.add_argument("--out", default=None, help="CSV path (default benchmarks/results/tool_rollouts_<gpu>.csv)")
    args = ap.parse_args(argv)
    args.models = args.models.split(",")
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {unknown}; choose from {sorted(MODELS)}")
    args.latency_ms = [float(x) for x in args.latency_ms.split(",")]
    args.turn_samplers = args.turn_samplers.split(",")
    args.single_samplers = [x for x in args.single_samplers.split(",") if x]
    if any(x not in ("eager", "compiled") for x in args.single_samplers):
        ap.error(f"--single-samplers: expected a comma list of eager, compiled; got {args.single_samplers}")
    raw, words = args.segment_prefill_tokens, {"none": None, "auto": "auto"}
    try:
        args.segment_prefill_tokens = [words[x.strip().lower()] if x.strip().lower() in words else int(x)
                                       for x in raw.split(",")]
    except ValueError:
        args.segment_prefill_tokens = [0]
    if any(isinstance(x, int) and x < 2 for x in args.segment_prefill_tokens):
        ap.error(f"--segment-prefill-tokens: expected a comma list of ints >= 2, 'none' or 'auto', got {raw!r}")
    bad = [t for t in args.turn_samplers if t not in ("eager_turns", "compiled_turns")]
    if bad or not args.turn_samplers:
        ap.error(f"--turn-samplers: unknown {bad}; choose from eager_turns, compiled_turns")
    if args.rows % GROUP:
        ap.error(f"--rows must be a multiple of G={GROUP}, got {args.rows}")
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for name in args.models:
        rows += bench_model(name, args, device)
        print(_table(rows, TABLE), flush=True)
    save_rows("tool_rollouts", FIELDS, rows, device, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
