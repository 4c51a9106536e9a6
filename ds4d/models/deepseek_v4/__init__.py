"""DeepSeek-V4 (Flash and Pro): config, official-format loader, forward pass, tiny checkpoints."""

from ds4d.models.deepseek_v4.config import DeepseekV4Config
from ds4d.models.deepseek_v4.family import DeepseekV4Family, load_model
from ds4d.models.deepseek_v4.make_tiny import main_make_tiny, write_tiny_checkpoint
from ds4d.models.deepseek_v4.model import DeepseekV4Model
from ds4d.models.deepseek_v4.paths import ForwardPaths

__all__ = [
    "DeepseekV4Config",
    "DeepseekV4Family",
    "DeepseekV4Model",
    "ForwardPaths",
    "load_model",
    "main_make_tiny",
    "write_tiny_checkpoint",
]
