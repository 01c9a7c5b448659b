"""Deprecated name of :mod:`logitless.rl.prompts` (the GRPO prompt datasets). ``logitless.rl.data.NAME``
still resolves, with a FutureWarning, so configs written with
``_component_: logitless.rl.data.gsm8k_dataset`` keep running; write ``logitless.rl.prompts.NAME``.
"""

import warnings

import logitless.rl.prompts as _prompts


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    warnings.warn(f"logitless.rl.data.{name} moved to logitless.rl.prompts.{name}; the old name will "
                  f"be removed", FutureWarning, stacklevel=2)
    return getattr(_prompts, name)
