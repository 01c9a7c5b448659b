"""Deprecated name of :mod:`logitless.datasets` (the SFT datasets, the bundled tiny assets and their
tokenizer). ``logitless.data.NAME`` still resolves, with a FutureWarning, so configs written with
``_component_: logitless.data.tiny_alpaca_dataset`` keep running; write ``logitless.datasets.NAME``.
"""

import logitless.datasets as _datasets
from logitless._moved import forward_to

__getattr__ = forward_to(__name__, _datasets)
