"""Former home of :mod:`logitless.rl.rollout.sampling`: its names still resolve here, with a FutureWarning."""

from logitless._moved import forward_to
from logitless.rl.rollout import sampling

__getattr__ = forward_to("logitless.rl.sampling", sampling)
