"""The chunked ops trace into one graph (no graph breaks, no host syncs) and match eager."""

import torch

import logitless


def _inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(40, 16, generator=g, requires_grad=True)
    w = torch.randn(301, 16, generator=g, requires_grad=True)
    y = torch.randint(0, 301, (40,), generator=g)
    y[::3] = -100
    return h, w, y


def _grads(fn, *args):
    out = fn(*args)
    out = out if isinstance(out, tuple) else (out,)
    sum(o.sum() for o in out).backward()
    grads = [args[0].grad.clone(), args[1].grad.clone()]
    args[0].grad = args[1].grad = None
    return [o.detach() for o in out] + grads


def test_fullgraph_compile_matches_eager():
    h, w, y = _inputs()

    def ce(h, w, y):
        return logitless.linear_cross_entropy(h, w, y, impl="chunked", chunk_size=16, temperature=0.9)

    def lp(h, w, y):
        return logitless.linear_log_probs(h, w, y, impl="chunked", chunk_size=16)

    for fn in (ce, lp):
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        for got, want in zip(_grads(compiled, h, w, y), _grads(fn, h, w, y)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
