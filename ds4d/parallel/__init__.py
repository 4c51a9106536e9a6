"""Several devices for one model: placement planning (``topology``) and process groups (``launch``).

Model-specific sharding lives with each model family (DeepSeek-V4:
``ds4d.models.deepseek_v4.shard`` and ``ds4d.models.deepseek_v4.parallel``).
"""
