"""Former home of :mod:`logitless.generation.builder`: its names still resolve here, with a FutureWarning."""

from logitless._moved import forward_to
from logitless.generation import builder

__getattr__ = forward_to("logitless.rl.samplers", builder)
