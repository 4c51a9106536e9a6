"""DeepSeek-V4.1: config, weights from a name -> tensor dict, the chunked forward with its per-sequence state."""

from ds4d.models.deepseek_v41.config import DeepseekV41Config, LayerPlan
from ds4d.models.deepseek_v41.engram import EngramHasher, compressed_vocabulary
from ds4d.models.deepseek_v41.model import DeepseekV41Model
from ds4d.models.deepseek_v41.state import SequenceState

__all__ = [
    "DeepseekV41Config",
    "DeepseekV41Model",
    "EngramHasher",
    "LayerPlan",
    "SequenceState",
    "compressed_vocabulary",
]
