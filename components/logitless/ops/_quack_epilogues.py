"""QuACK GEMM epilogues of the head (imports ``quack``: load only where it is installed).

QuACK mints and caches one kernel per epilogue function, keyed by the function's source and the
operands' metadata, so the function lives at module level, where a fresh process finds it again.
"""

import torch
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.ops import ColVecLoad, ColVecSelect, OnlineLSEReduce

_LABEL = ColVecLoad("target")


@gemm_epilogue(
    outs={"lse": OnlineLSEReduce("lse"), "target_logit": ColVecSelect("target_logit", idx_op=_LABEL)},
    extra_ops=(_LABEL,),
)
def _tempered_label_stats(acc, inv_temperature):
    """Each row's online log-sum-exp of ``acc * inv_temperature`` and the label's scaled fp32 logit."""
    z = acc * inv_temperature
    return {"D": z, "lse": z, "target_logit": z}


def label_log_prob_stats(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         inv_temperature: float) -> dict:
    """``{"lse": (N,), "target_logit": (N,)}`` fp32 of ``hidden @ weight.T * inv_temperature``; the
    logits are not stored. ``target_logit`` is left unwritten where the label is out of range."""
    return _tempered_label_stats(hidden, weight.mT, store_d=False, target=labels, tuned=False,
                                 inv_temperature=inv_temperature)
