"""What touches the model: the output-head wrapper, the label shift, prompt sharing and its cascade attention,
and the attention variant torchtune 0.6.1 lacks (per-head q/k norms before the rotary embedding)."""

# Public: __all__ (docs/CONTRACT.md). The other names are internal, imported here for the recipes and tests.
from logitless.modules.attention import QKNormAttention
from logitless.modules.cascade_attention import (
    CascadeLayout,
    cascade_attention,
    cascade_layout,
    enable_cascade_attention,
)
from logitless.modules.head import HeadInput, OUTPUT_MODES, head_weight, wrap_output_head
from logitless.modules.labels import shift_labels
from logitless.modules.prompt_sharing import (
    SharedPromptBatch,
    completion_rows,
    gather_predicting_rows,
    pack_groups,
)
from logitless.modules.unwrap import unwrap_compiled

__all__ = ["HeadInput", "head_weight", "shift_labels", "wrap_output_head"]
