"""cuflash: exact, IO-aware fused attention (FlashAttention) for CuPy arrays."""
from ._runtime.build import CompileError
from .api import attention, attention_backward, attention_forward, vjp
from .block_sparse import BlockLayout
from .estimate import Estimate, estimate
from .kvcache import attention_with_kvcache
from .merge import merge_attention
from .mods import MaskMod, ScoreMod, alibi, document_mask, prefix_lm_mask, relative_position_bias, softcap
from . import varlen

__version__ = "0.1.0"

__all__ = ["attention", "attention_forward", "attention_backward", "vjp", "merge_attention", "attention_with_kvcache", "varlen", "BlockLayout", "estimate", "Estimate", "CompileError",
           "ScoreMod", "MaskMod", "softcap", "alibi", "relative_position_bias", "document_mask", "prefix_lm_mask",
           "__version__"]
