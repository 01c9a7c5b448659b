"""Former home of :mod:`logitless.rl.rollout.compiled`; importing it from here still works, with a FutureWarning."""

import warnings

from logitless.rl.rollout.compiled import *  # noqa: F401,F403
from logitless.rl.rollout.compiled import CompiledSampler as FastGenerator  # noqa: F401

warnings.warn("logitless.rl.fast_generation moved to logitless.rl.rollout.compiled; the old path will be removed",
              FutureWarning, stacklevel=2)
