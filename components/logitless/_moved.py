"""Old module names kept working after a rename: attribute access forwarded, with a FutureWarning."""

import warnings
from types import ModuleType
from typing import Any, Callable


def forward_to(old_name: str, new_module: ModuleType) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for a renamed module.

    ``old.NAME`` returns ``new.NAME`` and warns once per access site that the old name will be
    removed, so configs naming ``_component_: old.NAME`` keep building the same component.

    Args:
        old_name (str): the old dotted module name.
        new_module (ModuleType): the module that holds the names now.

    Returns:
        Callable[[str], Any]: assign it to the old module's ``__getattr__``.

    Example:
        >>> __getattr__ = forward_to("logitless.data", logitless.datasets)
    """

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        warnings.warn(f"{old_name}.{name} moved to {new_module.__name__}.{name}; the old name will be removed",
                      FutureWarning, stacklevel=2)
        return getattr(new_module, name)

    return __getattr__
