"""Former home of :mod:`logitless.generation.eager` (and of ``decoding_layer`` and ``run_decoding_layer``,
now in :mod:`logitless.generation.trunk`): its names still resolve here, with a FutureWarning."""

from logitless._moved import forward_to
from logitless.generation import eager, trunk

_to_eager, _to_trunk = forward_to("logitless.rl.generation", eager), forward_to("logitless.rl.generation", trunk)


def __getattr__(name: str):
    return _to_trunk(name) if name in ("decoding_layer", "run_decoding_layer") else _to_eager(name)
