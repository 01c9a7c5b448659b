"""Former home of :mod:`logitless.rl.rollout.eager` (and of its ``Rollout``, ``left_pad``, ``decoding_layer``); importing it from here still works, with a FutureWarning."""

import warnings

from logitless.rl.rollout.eager import *  # noqa: F401,F403
from logitless.rl.rollout.result import Rollout, left_pad  # noqa: F401
from logitless.rl.rollout.trunk import decoding_layer, run_decoding_layer  # noqa: F401

warnings.warn("logitless.rl.generation moved to logitless.rl.rollout.eager; the old path will be removed",
              FutureWarning, stacklevel=2)
