"""Former home of :mod:`logitless.rl.rollout.builder`: its names still resolve here, with a FutureWarning."""

from logitless._moved import forward_to
from logitless.rl.rollout import builder

__getattr__ = forward_to("logitless.rl.samplers", builder)
