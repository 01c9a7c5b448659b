"""Former home of :mod:`logitless.generation.compiled`: its names still resolve here, with a FutureWarning."""

from logitless._moved import forward_to
from logitless.generation import compiled

__getattr__ = forward_to("logitless.rl.fast_generation", compiled)
