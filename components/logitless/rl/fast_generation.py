"""Former home of :mod:`logitless.rl.rollout.compiled`: its names still resolve here, with a FutureWarning."""

from logitless._moved import forward_to
from logitless.rl.rollout import compiled

__getattr__ = forward_to("logitless.rl.fast_generation", compiled)
