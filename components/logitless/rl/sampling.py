"""Former home of :mod:`logitless.generation.sampling`: its names still resolve here, with a FutureWarning."""

from logitless._moved import forward_to
from logitless.generation import sampling

__getattr__ = forward_to("logitless.rl.sampling", sampling)
