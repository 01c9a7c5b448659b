"""Former home of :mod:`logitless.rl.rollout.sampling`; importing it from here still works, with a FutureWarning."""

import warnings

from logitless.rl.rollout.sampling import *  # noqa: F401,F403

warnings.warn("logitless.rl.sampling moved to logitless.rl.rollout.sampling; the old path will be removed",
              FutureWarning, stacklevel=2)
