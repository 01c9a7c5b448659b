"""Deprecated name of :mod:`logitless.rl.prompts` (the GRPO prompt datasets). ``logitless.rl.data.NAME``
still resolves, with a FutureWarning, so configs written with
``_component_: logitless.rl.data.gsm8k_dataset`` keep running; write ``logitless.rl.prompts.NAME``.
"""

import logitless.rl.prompts as _prompts
from logitless._moved import forward_to

__getattr__ = forward_to(__name__, _prompts)
