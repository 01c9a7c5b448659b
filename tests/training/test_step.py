"""Gradient accumulation: weighting by non-ignored tokens of the whole accumulated batch."""

import copy

import pytest
import torch
import torch.nn.functional as F

from logitless.losses import CEWithChunkedOutputLoss, LinearCrossEntropyLoss
from logitless.models import qwen2_5_tiny
from logitless.training import SFTObjective, TrainStep

IGN = -100


def _batch(seed, b, s, n_ignored):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 2026, (b, s), generator=g)
    labels = tokens.clone()
    labels.view(-1)[:n_ignored] = IGN  # very different token counts per micro-batch
    return {"tokens": tokens, "labels": labels}


def _reference_grads(model, batches):
    """One big batch, plain full logits, mean CE over every non-ignored token."""
    tokens = torch.cat([b["tokens"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGN)], dim=1)
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), shifted.reshape(-1), ignore_index=IGN)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("loss_cls", [CEWithChunkedOutputLoss, LinearCrossEntropyLoss])
def test_accumulated_step_equals_one_big_batch(loss_cls):
    torch.manual_seed(0)
    ref_model = qwen2_5_tiny(num_layers=1, embed_dim=64, intermediate_dim=128, max_seq_len=64)
    model = copy.deepcopy(ref_model)
    batches = [_batch(1, 2, 12, 20), _batch(2, 2, 12, 0), _batch(3, 2, 12, 23)]  # 20, 0 and 23 ignored labels
    ref_loss, ref_grads = _reference_grads(ref_model, batches)

    grads = {}

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
            return super().step(closure)

    obj = SFTObjective(model, loss_cls())
    step = TrainStep(model, Capture(model.parameters(), lr=0.0), grads_averaged_over_ranks=False)
    res = step(batches, obj)
    n_ref = sum(int((b["labels"][:, 1:] != IGN).sum()) for b in batches)
    assert res.num_units == n_ref
    assert res.loss == pytest.approx(ref_loss, rel=1e-5)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_all_ignored_batch_skips_the_step():
    torch.manual_seed(0)
    model = qwen2_5_tiny(num_layers=1, embed_dim=64, intermediate_dim=128, max_seq_len=64)
    before = copy.deepcopy(model.state_dict())
    obj = SFTObjective(model, CEWithChunkedOutputLoss())
    step = TrainStep(model, torch.optim.AdamW(model.parameters(), lr=1.0), clip_grad_norm=1.0)
    b = _batch(0, 2, 8, 16)
    with pytest.warns(UserWarning, match="no units"):
        res = step([b], obj)
    assert not res.stepped and res.loss == 0.0 and res.num_units == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_step_rejects_bad_arguments():
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="clip_grad_norm"):
        TrainStep(m, torch.optim.SGD(m.parameters(), lr=1), clip_grad_norm=0.0)
    tiny = qwen2_5_tiny(num_layers=1, embed_dim=64, intermediate_dim=64)
    with pytest.raises(ValueError, match="no micro-batches"):
        TrainStep(m, torch.optim.SGD(m.parameters(), lr=1))([], SFTObjective(tiny, LinearCrossEntropyLoss()))
    with pytest.raises(TypeError, match="loss protocol: expected a logitless.losses.StepLoss"):
        SFTObjective(tiny, torch.nn.CrossEntropyLoss())


class _NotAnObjective:
    def units(self, mb):
        return None

    def __call__(self, mb, total):
        return None


class _BareLoss(SFTObjective):
    """Returns the loss tensor alone instead of a LossOutput."""

    def __call__(self, batch, total):
        return super().__call__(batch, total).loss


def test_wrong_objects_raise_a_type_error_naming_the_contract():
    from logitless.losses import TokenLogProbs

    model = qwen2_5_tiny(num_layers=1, embed_dim=64, intermediate_dim=128, max_seq_len=64)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0))
    b = _batch(0, 2, 8, 0)
    with pytest.raises(TypeError, match="objective must be a logitless.training.step.StepObjective"):
        step([b], _NotAnObjective())
    with pytest.raises(TypeError, match="expected a logitless.losses.LossOutput"):
        step([b], _BareLoss(model, LinearCrossEntropyLoss()))
    with pytest.raises(TypeError, match="expected a logitless.losses.StepLoss"):
        SFTObjective(model, TokenLogProbs())  # a head loss, but per-token values: not a step loss
    with pytest.raises(TypeError, match="runtime must be a logitless.training.distributed.Runtime"):
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), runtime="cpu")


_TWO_RANK_WORKER = '''
import sys
import torch
from logitless.losses import LinearCrossEntropyLoss
from logitless.training import SFTObjective, TrainStep
from logitless.training.distributed import Runtime, free_finished_run
sys.path.insert(0, sys.argv[2])
from test_step import _two_rank_setup

rt = Runtime.setup("cpu", distributed=True)
model, batches = _two_rank_setup()
obj = SFTObjective(model, LinearCrossEntropyLoss(impl="chunked"))
rt.shard(model)
step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.5), clip_grad_norm=0.5, runtime=rt)
res = step(batches[2 * rt.rank: 2 * rt.rank + 2], obj)
state = rt.full_state_dict(model)
if rt.is_rank_zero:
    torch.save({"loss": res.loss, "grad_norm": res.grad_norm, "num_units": res.num_units, "state": state}, sys.argv[1])
rt.shutdown()
# freed now, as the recipes' entry points do: FSDP2 modules left to the interpreter's exit can abort
# the finished process while gloo's threads still run ("terminate called without an active exception")
del model, obj, step, res, state
free_finished_run()
'''


def _two_rank_setup():
    torch.manual_seed(0)
    model = qwen2_5_tiny(vocab_size=48, num_layers=1, num_heads=2, num_kv_heads=1, embed_dim=32, intermediate_dim=64)
    batches = []
    for i, n_ignored in enumerate((3, 14, 0, 9)):  # the ranks hold 17 and 9 ignored labels
        b = _batch(10 + i, 2, 8, n_ignored)
        b["tokens"] %= 48
        b["labels"] = torch.where(b["labels"] == IGN, IGN, b["labels"] % 48)
        batches.append(b)
    return model, batches


def test_two_gloo_ranks_equal_one_device(tmp_path):
    """FSDP2 over two CPU ranks: the ranks' micro-batches (different token counts) give the same
    loss, clipped gradient norm and weights as the four micro-batches on one device."""
    import os
    import socket
    import subprocess
    import sys

    worker = tmp_path / "worker.py"
    worker.write_text(_TWO_RANK_WORKER)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--master_port={port}", str(worker), str(tmp_path / "out.pt"),
                          os.path.dirname(__file__)], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    dist = torch.load(tmp_path / "out.pt")

    model, batches = _two_rank_setup()
    obj = SFTObjective(model, LinearCrossEntropyLoss(impl="chunked"))
    one = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.5), clip_grad_norm=0.5)(batches, obj)
    assert dist["num_units"] == one.num_units == sum(int((b["labels"][:, 1:] != IGN).sum()) for b in batches)
    assert one.grad_norm > 0.5  # the clip is active
    assert dist["loss"] == pytest.approx(one.loss, rel=1e-6)
    assert dist["grad_norm"] == pytest.approx(one.grad_norm, rel=1e-5)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(dist["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)
