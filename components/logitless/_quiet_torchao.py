"""Drops one harmless torchao log record: the cpp-extension notice it logs at import.

torchao 0.13-0.15 (the range torchtune 0.6.1 imports) logs ``"Skipping import of cpp extensions due to
incompatible torch version ..."`` through ``logging.getLogger("torchao")`` whenever torch is newer than
the build it shipped for; torchtune then uses only torchao's Python code, so the notice says nothing a
logitless user can act on. Only that record is dropped, and only when this runs before torchao's
first import: ``import logitless`` does it first thing, and the recipe modules import ``logitless``
before torchtune (a ``tune`` process itself imports torchtune before any logitless code can run;
``logitless run`` does not).
"""

from __future__ import annotations

import logging

_PREFIX = "Skipping import of cpp extensions due to incompatible torch version"


class _DropCppExtensionNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_PREFIX)


def quiet_torchao_cpp_extension_notice() -> None:
    """Installs the filter on the ``torchao`` logger (idempotent)."""
    logger = logging.getLogger("torchao")
    if not any(isinstance(f, _DropCppExtensionNotice) for f in logger.filters):
        logger.addFilter(_DropCppExtensionNotice())
