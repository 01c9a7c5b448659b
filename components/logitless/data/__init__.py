"""Deprecated name of :mod:`logitless.datasets` (the SFT datasets, the bundled tiny assets and their
tokenizer). ``logitless.data.NAME`` still resolves, with a FutureWarning, so configs written with
``_component_: logitless.data.tiny_alpaca_dataset`` keep running; write ``logitless.datasets.NAME``.
"""

import warnings

import logitless.datasets as _datasets


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    warnings.warn(f"logitless.data.{name} moved to logitless.datasets.{name}; the old name will be "
                  f"removed", FutureWarning, stacklevel=2)
    return getattr(_datasets, name)
