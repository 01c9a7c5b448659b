"""Former home of :mod:`logitless.rl.rollout.builder`; importing it from here still works, with a FutureWarning."""

import warnings

from logitless.rl.rollout.builder import *  # noqa: F401,F403

warnings.warn("logitless.rl.samplers moved to logitless.rl.rollout.builder; the old path will be removed",
              FutureWarning, stacklevel=2)
