"""What touches the model: the output-head wrapper, the label shift and prompt sharing."""

from logitless.modules.head import HeadInput, OUTPUT_MODES, head_weight, wrap_output_head
from logitless.modules.labels import shift_labels
from logitless.modules.prompt_sharing import (
    SharedPromptBatch,
    completion_rows,
    gather_predicting_rows,
    pack_groups,
)
from logitless.modules.unwrap import unwrap_compiled

__all__ = [
    "HeadInput",
    "OUTPUT_MODES",
    "SharedPromptBatch",
    "completion_rows",
    "gather_predicting_rows",
    "head_weight",
    "pack_groups",
    "shift_labels",
    "unwrap_compiled",
    "wrap_output_head",
]
