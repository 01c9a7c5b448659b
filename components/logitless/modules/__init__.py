"""What touches the model: the output-head wrapper and the label shift."""

from logitless.modules.head import HeadInput, OUTPUT_MODES, head_weight, wrap_output_head
from logitless.modules.labels import shift_labels

__all__ = ["HeadInput", "OUTPUT_MODES", "head_weight", "wrap_output_head", "shift_labels"]
