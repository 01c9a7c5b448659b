"""Every ``LOGITLESS_*`` environment knob in one place: its default, its type and what it trades.

The knobs tune how the kernels spend memory and time; none changes what a loss computes beyond
float rounding. Each one is read from the environment when it is used (so a test or a launcher can
set it), falls back to its default, and a value that does not parse stops with an error naming the
variable, the value and what was expected. :func:`describe` renders the table that
docs/CONTRACT.md lists.

Workspace sizes and tile widths are read once, when :mod:`logitless.ops.triton.head` is imported
(they size buffers); the switches (``chunked_compile``, ``triton_compact``, ``head_gemm``, ``debug``) are
read at every call.

Example:
    >>> from logitless.settings import settings
    >>> settings.triton_workspace_mb
    224
    >>> with settings.override(triton_compact=False):
    ...     assert settings.triton_compact is False
"""

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List

__all__ = ["HEAD_GEMM_BACKENDS", "Knob", "KNOBS", "Settings", "settings", "describe"]

#: The head's GEMM backends (``LOGITLESS_HEAD_GEMM``, the ops' and losses' ``gemm_backend``).
HEAD_GEMM_BACKENDS = ("cublas", "triton", "quack", "auto")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected one of {_TRUE + _FALSE[1:]}")


def _int_at_least(minimum: int) -> Callable[[str], int]:
    expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

    def parse(raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError(f"expected {expected}") from None
        if value < minimum:
            raise ValueError(f"expected {expected}")
        return value

    return parse


def _choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in options:
            raise ValueError(f"expected one of {options}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


@dataclass(frozen=True)
class Knob:
    """One environment knob.

    Attributes:
        env (str): the environment variable.
        default (Any): the value when it is unset.
        parse (Callable[[str], Any]): text -> value; raises ``ValueError`` saying what it expects.
        doc (str): what it does and what it trades.
    """

    env: str
    default: Any
    parse: Callable[[str], Any]
    doc: str


KNOBS: Dict[str, Knob] = {
    "debug": Knob(
        "LOGITLESS_DEBUG", False, lambda raw: raw.strip().lower() not in _FALSE,
        "Recipes print the full traceback of a configuration error instead of one line (exit 2)."),
    "chunked_compile": Knob(
        "LOGITLESS_CHUNKED_COMPILE", True, _flag,
        "impl='chunked' on CUDA compiles its per-chunk softmax work (cross-entropy, log-probs + "
        "entropy and their gradient, the token objective's gradient; torch.compile, dynamic shapes) for "
        "bf16/fp16 inputs: a few memory passes per chunk instead of about ten, chunks of twice the rows "
        "in the same budget, one compile per process."),
    "triton_workspace_mb": Knob(
        "LOGITLESS_TRITON_WORKSPACE_MB", 224, _positive_int,
        "MiB of the reused logits buffer of the fused head when gradients are computed: larger "
        "chunks (fewer dW roundings, fewer launches) for more peak memory."),
    "triton_forward_workspace_mb": Knob(
        "LOGITLESS_TRITON_FORWARD_WORKSPACE_MB", 88, _positive_int,
        "MiB of forward-only calls' workspace (no gradient): the logits tiles and, when ignored rows "
        "are compacted away, the gathered hidden rows of a block; larger tiles for more peak memory."),
    "triton_fused_max_chunks": Knob(
        "LOGITLESS_TRITON_FUSED_MAX_CHUNKS", 8, _non_negative_int,
        "Cross-entropy and token objectives take the one-pass 3-GEMM path while the valid rows fit "
        "in at most this many chunks; above it the 4-GEMM path, whose dW is rounded once per row "
        "block (more chunks round dW more often: less accurate than plain PyTorch at 152k vocabularies)."),
    "triton_objective_compile": Knob(
        "LOGITLESS_TRITON_OBJECTIVE_COMPILE", True, _flag,
        "The fused token objective's one pass computes each chunk's objective value and its "
        "gradient w.r.t. (log-prob, entropy) with a torch.compile'd torch.func.grad_and_value of the "
        "objective (a few fused kernels instead of ~50 eager ones; compiled once per process, "
        "dynamic shapes) on CUDA. An objective that does not compile runs eagerly."),
    "triton_objective_graph": Knob(
        "LOGITLESS_TRITON_OBJECTIVE_GRAPH", True, _flag,
        "The fused token objective's one pass replays its per-chunk objective call (compiled or "
        "eager) from a CUDA graph captured once per call: at many chunks the host otherwise falls "
        "behind the GPU. An objective that cannot be captured (a host sync, CPU work) runs "
        "without the graph."),
    "triton_pinned_mb": Knob(
        "LOGITLESS_TRITON_PINNED_MB", 128, _non_negative_int,
        "Pinned label columns of a one-pass cross-entropy or token objective: the most frequent "
        "labels' columns and every other row's own label entry are moved out of each chunk's bf16 "
        "dW accumulation and summed in fp32 (one rounding), so the one pass keeps plain PyTorch's "
        "dW accuracy over many chunks. Used while valid rows x pinned columns dlogits would fit "
        "these MiB (the range it was measured in; the pass holds one chunk's of them and the pinned "
        "dW rows' fp32 sums) and no first block is cached; 0 turns it off."),
    "triton_pinned_columns": Knob(
        "LOGITLESS_TRITON_PINNED_COLUMNS", 1024, _positive_int,
        "How many of the most frequent labels' columns are pinned whole (at most the valid rows "
        "and V); more cost more of each chunk's sectors to move."),
    "triton_pinned_max_chunks": Knob(
        "LOGITLESS_TRITON_PINNED_MAX_CHUNKS", 96, _non_negative_int,
        "With pinned label columns, the one-pass 3-GEMM path runs up to this many row chunks (the "
        "other dW rows are still rounded once per chunk); above it, the 4-GEMM path."),
    "triton_cache_first_block": Knob(
        "LOGITLESS_TRITON_CACHE_FIRST_BLOCK", False, _flag,
        "One-pass CE keeps its first row block's logits in dW's still-unwritten buffer: fewer "
        "chunks follow, no extra memory; off by default until it is measured faster on a GPU."),
    "triton_compact": Knob(
        "LOGITLESS_TRITON_COMPACT", True, _flag,
        "Ignored rows are dropped before the head's GEMMs: less work per ignored token, at the cost "
        "of one device-to-host sync for their count (skipped automatically under CUDA-graph capture)."),
    "triton_block_v": Knob(
        "LOGITLESS_TRITON_BLOCK_V", 4096, _positive_int,
        "Columns per program iteration in the Triton epilogue kernels (64 under TRITON_INTERPRET)."),
    "triton_prefetch": Knob(
        "LOGITLESS_TRITON_PREFETCH", True, _flag,
        "The row-statistics kernel loads the next column block before reducing the current one: "
        "hides load latency for more registers."),
    "triton_programs_per_sm": Knob(
        "LOGITLESS_TRITON_PROGRAMS_PER_SM", 8, _positive_int,
        "Programs per SM the epilogue grids aim for (rows x column splits): more splits keep small "
        "chunks streaming, for more partial results to merge."),
    "head_gemm": Knob(
        "LOGITLESS_HEAD_GEMM", "auto", _choice(*HEAD_GEMM_BACKENDS),
        "GEMMs of impl='triton': 'cublas' (cuBLAS GEMMs over logits tiles, Triton epilogue kernels "
        "between them), 'triton' (persistent Triton GEMMs with the statistics / dlogits / dW "
        "accumulation in their epilogues: no logits workspace, no logits round trip; slower than "
        "cublas on an H200 at the 7B head, more accurate log-probs), 'quack' (the forward on QuACK's "
        "CuTe-DSL GEMM with the statistics in its epilogue: log-probs without entropy or gradients, "
        "e.g. GRPO's reference and old passes, with the log-sum-exp and the label's logit; the "
        "forward of log-probs + entropy, with or without a backward to follow, with per-tile sums "
        "where a tile of 192, 128 or 256 columns divides V; bf16 on sm_90, H % 8 == 0; needs "
        "quack-kernels; the recompute backward's logits GEMM storing the dlogits where V % 8 == 0 "
        "and V >= 1024; the one pass of cross-entropy and of the token objective with the chunks' "
        "logits GEMM storing the logits and their per-tile sums and the chunks' dW GEMMs adding "
        "through the store, where the forward's tile divides V; dh and every other call as "
        "cublas), 'auto' (quack where it applies and "
        "quack-kernels is installed, else cublas; triton at no shape, since a committed H200 "
        "measurement says it wins at none). Inputs a tensor descriptor cannot read (H * itemsize "
        "not a multiple of 16 bytes) keep cublas."),
    "head_gemm_programs_per_sm": Knob(
        "LOGITLESS_HEAD_GEMM_PROGRAMS_PER_SM", 1, _positive_int,
        "Persistent programs per SM of the Triton head GEMMs (LOGITLESS_HEAD_GEMM=triton): more "
        "hide epilogue latency behind another tile's main loop, for more registers and shared memory."),
    "triton_num_warps": Knob(
        "LOGITLESS_TRITON_NUM_WARPS", 4, _positive_int,
        "Warps per program of the epilogue kernels."),
}


class Settings:
    """Attribute access to :data:`KNOBS`, read from the environment at each access.

    Example:
        >>> settings.triton_fused_max_chunks
        8
    """

    def __init__(self, knobs: Dict[str, Knob]):
        object.__setattr__(self, "_knobs", knobs)
        object.__setattr__(self, "_overrides", {})

    def __getattr__(self, name: str) -> Any:
        knobs = object.__getattribute__(self, "_knobs")
        if name not in knobs:
            raise AttributeError(f"logitless.settings has no knob {name!r}; knobs: {sorted(knobs)}")
        overrides = object.__getattribute__(self, "_overrides")
        if name in overrides:
            return overrides[name]
        knob = knobs[name]
        raw = os.environ.get(knob.env)
        if raw is None:
            return knob.default
        try:
            return knob.parse(raw)
        except ValueError as err:
            raise ValueError(f"environment variable {knob.env}={raw!r}: {err}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("logitless.settings is read-only; set the environment variable or use "
                             "settings.override(...)")

    @contextmanager
    def override(self, **values: Any) -> Iterator["Settings"]:
        """Sets knobs for the duration of a ``with`` block (over the environment).

        Args:
            **values: knob name -> value.

        Raises:
            AttributeError: for an unknown knob name.
        """
        knobs = object.__getattribute__(self, "_knobs")
        unknown = sorted(set(values) - set(knobs))
        if unknown:
            raise AttributeError(f"logitless.settings has no knob(s) {unknown}; knobs: {sorted(knobs)}")
        overrides = object.__getattribute__(self, "_overrides")
        saved = dict(overrides)
        overrides.update(values)
        try:
            yield self
        finally:
            overrides.clear()
            overrides.update(saved)


#: The process-wide settings.
settings = Settings(KNOBS)


def describe() -> List[str]:
    """The knob table as Markdown lines (variable, default, what it does), as docs/CONTRACT.md lists it.

    Returns:
        List[str]: the table's lines.
    """
    lines = ["| variable | default | what it does, what it trades |", "|---|---|---|"]
    for knob in KNOBS.values():
        default = ("1" if knob.default else "0") if isinstance(knob.default, bool) else str(knob.default)
        lines.append(f"| `{knob.env}` | {default} | {knob.doc} |")
    return lines
