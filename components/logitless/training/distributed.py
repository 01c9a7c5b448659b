"""Where a recipe's process trains: one device, or FSDP2 over every rank of the process group.

:class:`Runtime` is what the SFT and GRPO recipes share about data parallelism, so that neither
branches on it more than once: the process group and device (``LOCAL_RANK`` under ``torchrun``),
sharding with torchtune's ``shard_model``, full weights for no-grad work such as sampling,
the full state dict and optimizer state for checkpoints, and the few collectives the recipes need.
On one device every collective is the identity and the model is never wrapped.

Sharding (:meth:`Runtime.shard`): every ``TransformerSelfAttentionLayer`` is one FSDP2 unit and the
root unit holds the rest (embedding, final norm, head). The root does not reshard after its
forward: the logitless losses project the hidden states with the head weight AFTER the model's
forward (``HeadInput``), so that weight must stay the gathered parameter until backward, which
reduce-scatters its gradient like any other.
"""

from __future__ import annotations

import contextlib
import gc
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List

import torch
import torch.distributed as dist
from torch import nn
from torchtune import modules as tt_modules
from torchtune import training as tt_training

from logitless.training.checkpoint import rng_state
from logitless.training.config import Key


#: Config keys of the FSDP2 recipes (added to their schemas).
FSDP_KEYS: Dict[str, Key] = {
    "fsdp_cpu_offload": Key(bool, default=False, doc="FSDP2 CPU offload of parameters, gradients, optimizer"),
    "fsdp_reshard_after_forward": Key(bool, default=True, doc="free each layer's gathered weights after its forward"),
}


def launched_world_size() -> int:
    """The number of ranks of this launch: the process group's, else ``WORLD_SIZE`` (``torchrun``), else 1.

    Lets a recipe validate its config against the world size before it joins the process group.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def free_finished_run() -> None:
    """Frees, now, the objects of a run its entry point has dropped (the recipe, its model, optimizer
    and sampler), rather than at the interpreter's exit.

    FSDP2 modules sit in reference cycles, so only the cyclic collector frees them. Left to the
    interpreter's exit, they are torn down while gloo's threads still run, which can abort a run that
    has finished and saved ("terminate called without an active exception", SIGABRT, exit status
    non-zero under ``torchrun``).

    Example:
        >>> SFTRecipe(cfg, distributed=True).run()
        >>> free_finished_run()
    """
    gc.collect()


def _fsdp_units(model: nn.Module) -> List[nn.Module]:
    """The FSDP2 units of ``model`` (root first); empty for a model that is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@dataclass
class Runtime:
    """This process's place in the run and the collectives a recipe uses (identities on one device).

    Attributes:
        device (torch.device): where this rank trains (``cuda:LOCAL_RANK`` under ``torchrun``).
        rank (int): this rank (0 on one device).
        world_size (int): number of data-parallel ranks (1 on one device).
        distributed (bool): FSDP2 over the process group.
        reshard_after_forward (bool): the layers' FSDP2 setting (set by :meth:`shard`).

    Example:
        >>> rt = Runtime.setup("cpu", distributed=False)
        >>> rt.all_reduce(torch.tensor([2.0])), rt.share(4), rt.is_rank_zero
        (tensor([2.]), range(0, 4), True)
    """

    device: torch.device
    rank: int = 0
    world_size: int = 1
    distributed: bool = False
    reshard_after_forward: bool = True
    _rooted: "weakref.WeakSet[nn.Module]" = field(default_factory=weakref.WeakSet, repr=False)

    @classmethod
    def setup(cls, device: str, *, distributed: bool) -> "Runtime":
        """Initialises the process group (distributed) and chooses the device.

        Args:
            device (str): ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
                Distributed, ``"cuda"`` means ``cuda:LOCAL_RANK``.
            distributed (bool): join the process group that ``torchrun`` / ``tune run
                --nproc_per_node`` describes (nccl on CUDA, gloo on the CPU).

        Returns:
            Runtime: the runtime of this process.
        """
        use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        rank, world_size = 0, 1
        if distributed:
            if not (dist.is_available() and dist.is_initialized()):
                dist.init_process_group(backend="nccl" if use_cuda else "gloo")
            rank, world_size = dist.get_rank(), dist.get_world_size()
        if not use_cuda:
            dev = torch.device("cpu")
        elif device.startswith("cuda:"):
            dev = torch.device(device)
        else:
            # An explicit index: torch.cuda.set_device rejects a bare "cuda".
            index = int(os.environ.get("LOCAL_RANK", 0)) if distributed else torch.cuda.current_device()
            dev = torch.device(f"cuda:{index}")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        return cls(device=dev, rank=rank, world_size=world_size, distributed=distributed)

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ model
    def shard(self, model: nn.Module, *, cpu_offload: bool = False, reshard_after_forward: bool = True) -> None:
        """FSDP2 over the ranks: one unit per transformer layer plus the root (no-op on one device).

        Args:
            model (nn.Module): a torchtune ``TransformerDecoder`` (wrapped by the loss already).
            cpu_offload (bool): FSDP2's CPU offload of parameters, gradients and optimizer state.
            reshard_after_forward (bool): free the layers' gathered weights after their forward.
        """
        if not self.distributed:
            return
        self.reshard_after_forward = reshard_after_forward
        tt_training.shard_model(
            model, [lambda n, m: isinstance(m, tt_modules.TransformerSelfAttentionLayer)],
            cpu_offload=cpu_offload, reshard_after_forward=reshard_after_forward)
        # The head weight handed to the loss must outlive the forward (see the module docstring).
        model.set_reshard_after_forward(False, recurse=False)

    @contextlib.contextmanager
    def full_weights(self, model: nn.Module) -> Iterator[None]:
        """Keeps every FSDP2 unit of ``model`` gathered for a no-grad phase (sampling, evaluation).

        A decode step calls the layers once per token: sharded, each call would all-gather its
        weights again. Inside this context the weights are gathered once (one full copy of the
        model per rank, freed on exit) and a rank decodes alone at single-device speed, taking
        as many steps as its own prompts need. Every rank must enter it (the gather is a
        collective). A no-op on one device.

        Args:
            model (nn.Module): the sharded model.

        Example:
            >>> with runtime.full_weights(model):
            ...     rollout = generate(model, prompts, ...)
        """
        units = _fsdp_units(model)
        if not units:
            yield
            return
        root = units[0]
        if root is not model:
            raise ValueError(f"model: expected the FSDP2 root module, got {type(model).__name__} "
                             f"whose root unit is {type(root).__name__}")
        if model not in self._rooted:
            # FSDP2 takes the first unit to run a forward as the root; the samplers call the layers
            # directly, so let the model's own forward (one token) be the first.
            with torch.no_grad():
                model(torch.zeros(1, 1, dtype=torch.long, device=self.device))
            self._rooted.add(model)
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        try:
            yield
        finally:
            self.release(model)
            for unit in units:
                unit.set_reshard_after_forward(self.reshard_after_forward and unit is not root, recurse=False)

    @torch.no_grad()
    def copy_full_weights(self, src: nn.Module, dst: nn.Module, *, trainable_only: bool = False) -> None:
        """Copies the full weights of ``src`` (possibly sharded) into the same-named parameters of ``dst``.

        ``dst`` is an unsharded model of the same architecture, such as the copy of the policy that
        a sharded GRPO run samples with. Its parameters keep their storage, so a CUDA graph
        captured over ``dst`` stays valid. Each sharded parameter is gathered, copied and freed in
        turn (one parameter's full size at a time). Every rank must call this; the collectives
        run in the order of ``src.named_parameters()``.

        Args:
            src (nn.Module): the model being trained (FSDP2-sharded or not).
            dst (nn.Module): an unsharded model with every parameter of ``src``.
            trainable_only (bool): copy only the parameters that require grad (the others, such
                as a LoRA policy's frozen base weights, are already in ``dst``).

        Raises:
            ValueError: a parameter of ``src`` is missing from ``dst`` or has another shape.
        """
        from torch.distributed.tensor import DTensor

        targets = dict(dst.named_parameters())
        for name, param in src.named_parameters():
            if trainable_only and not param.requires_grad:
                continue
            key = name.replace("._checkpoint_wrapped_module", "")
            target = targets.get(key)
            if target is None or tuple(target.shape) != tuple(param.shape):
                raise ValueError(f"dst: expected a parameter {key!r} of shape {tuple(param.shape)}, got "
                                 f"{None if target is None else tuple(target.shape)}")
            full = param.full_tensor() if isinstance(param, DTensor) else param
            target.copy_(full)
            del full

    def release(self, model: nn.Module) -> None:
        """Frees the weights that a no-grad forward left gathered (no-op on one device).

        The root unit keeps its weights after its forward (for the head, see the module docstring)
        and only a backward frees them; a model that never runs backward, such as a frozen
        reference policy, calls this after its forwards.
        """
        for unit in _fsdp_units(model):
            unit.reshard()

    # ------------------------------------------------------------------ checkpoints
    def full_state_dict(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        """The model's full weights on the CPU on rank 0 (empty on other ranks; all ranks call it).

        Activation-checkpointing wrapper names are removed, so the keys are the model's own.
        """
        if self.distributed:
            sd = tt_training.gather_cpu_state_dict(model, self.is_rank_zero, device=self.device)
        else:
            sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        return {k.replace("._checkpoint_wrapped_module", ""): v for k, v in sd.items()}

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        """The optimizer's full (unsharded) state dict, complete on rank 0 (all ranks call it)."""
        if self.distributed:
            return tt_training.get_full_optimizer_state_dict(model, optimizer, self.is_rank_zero)
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: Dict[str, Any]) -> None:
        """Loads a state dict from :meth:`optimizer_state_dict` (sharded again over the ranks)."""
        if self.distributed:
            tt_training.load_from_full_optimizer_state_dict(model, optimizer, state, self.device)
        else:
            optimizer.load_state_dict(state)

    def rng_states(self) -> List[Dict[str, Any]]:
        """The RNG snapshot of every rank, in rank order (all ranks call it)."""
        if not self.distributed:
            return [rng_state()]
        states: List[Any] = [None] * self.world_size
        dist.all_gather_object(states, rng_state())
        return states

    def own_rng_state(self, states: List[Dict[str, Any]]) -> Dict[str, Any]:
        """This rank's entry of :meth:`rng_states` (rank 0's when saved by another world size; a
        single snapshot, as older checkpoints hold, as it is)."""
        if isinstance(states, dict):
            return states
        return states[self.rank] if len(states) == self.world_size else states[0]

    # ------------------------------------------------------------------ collectives
    def share(self, n: int) -> range:
        """This rank's contiguous share of ``n`` items (the first ``n % world_size`` ranks get one more).

        Example:
            >>> Runtime(torch.device("cpu"), rank=1, world_size=2, distributed=True).share(5)
            range(3, 5)
        """
        base, extra = divmod(n, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``tensor`` reduced over the ranks (``"sum"`` or ``"max"``), on ``tensor``'s device.

        The input is left unchanged; the reduction runs on this rank's device (NCCL needs CUDA).
        """
        if not self.distributed:
            return tensor
        out = tensor.to(self.device, copy=True)
        dist.all_reduce(out, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return out.to(tensor.device)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (the same shape on all ranks) concatenated along dim 0 in rank order,
        on ``tensor``'s device."""
        if not self.distributed:
            return tensor
        local = tensor.to(self.device).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        return torch.cat(parts).to(tensor.device)

    def all_gather_object(self, items: List[Any]) -> List[Any]:
        """Every rank's list of picklable ``items`` concatenated in rank order (``items`` itself on one device)."""
        if not self.distributed:
            return items
        parts: List[Any] = [None] * self.world_size
        dist.all_gather_object(parts, items)
        return [x for part in parts for x in part]

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (a picklable object; returned as is on one device)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def shutdown(self) -> None:
        """Leaves the process group (distributed)."""
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()
