"""Probe: on a GPU in bf16, does a tool's latency change what the multi-turn samplers sample?

The draws are keyed by (row, position) and every row writes its own cache columns, so a row's tokens
depend on the schedule only through numerics: whether a row's logits at a step are bit-identical
whatever the other rows of the batch hold and wherever they are. This probe measures, on random
Qwen2.5-0.5B weights (bf16):

1. row independence of the pieces: the rows of a decode-shaped forward (64 rows x 1 token over a
   cache) when the other rows' tokens change: the eager reference's forward (torchtune's layers,
   SDPA under a key mask) and the compiled turn step (grouped attention, split-K kernel);
2. whole rollouts: the same sampler twice with instant tools (run-to-run), and with instant vs
   50 ms tools: the fraction of rows whose tokens are identical, and the first position where a
   differing row departs.

    PYTHONPATH=components python experiments/probe_turn_determinism.py
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_generation import build_model  # noqa: E402
import bench_tool_rollouts as tr  # noqa: E402


def rows_independent(model, device):
    """Max |difference| of row 0's last-position logits when rows 1.. get other tokens: a full
    forward of 64 x 300 tokens (GEMMs, causal SDPA) and the single-token shape of a decode step."""
    vocab = model.tok_embeddings.num_embeddings
    g = torch.Generator().manual_seed(0)
    out = {}
    for label, shape in (("prefill 64x300", (64, 300)), ("decode GEMMs 64x1", (64, 1))):
        a = torch.randint(1, vocab, shape, generator=g).to(device)
        b = a.clone()
        b[1:] = torch.randint(1, vocab, (shape[0] - 1, shape[1]), generator=g).to(device)
        with torch.no_grad():
            la, lb = model(a)[0, -1].float(), model(b)[0, -1].float()
        out[label] = float((la - lb).abs().max())
    return out


def rollout_pair(model, sampler, args, latency_ms):
    _, ref = tr.multi_turn(model, sampler, args, 0, seed=1)
    _, other = tr.multi_turn(model, sampler, args, latency_ms, seed=1)
    n = min(ref.completion_tokens.shape[1], other.completion_tokens.shape[1])
    a, b = ref.completion_tokens[:, :n], other.completion_tokens[:, :n]
    same = (a == b).all(1) & (ref.completion_tokens.shape == other.completion_tokens.shape)
    first = [int((a[r] != b[r]).nonzero()[0]) for r in range(a.shape[0]) if not bool((a[r] == b[r]).all())]
    return float(same.float().mean()), sorted(first)[:8]


def main():
    from logitless.generation.tools.compiled import CompiledTurnSampler
    from logitless.generation.tools.eager import generate_turns

    device = torch.device("cuda")
    model = build_model("0.5b", device)
    print("row independence (max |d logit| of row 0):", rows_independent(model, device), flush=True)
    args = tr.parse_args(["--models", "0.5b", "--rows", "32", "--turns", "3", "--turn-tokens", "48",
                          "--tool-tokens", "16", "--prompt-len", "128"])
    for label, sampler in (("eager", generate_turns),
                           ("compiled", CompiledTurnSampler(compile=True, fused_projections="shared"))):
        tr.multi_turn(model, sampler, args, 0, seed=0)  # warm-up / compile
        t0 = time.perf_counter()
        print(f"{label}: run-to-run (instant, instant): same rows, first departures", rollout_pair(model, sampler, args, 0),
              flush=True)
        print(f"{label}: instant vs 50 ms tools: same rows, first departures", rollout_pair(model, sampler, args, 50),
              f"({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
