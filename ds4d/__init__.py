"""ds4d: a DeepSeek-V4 inference daemon with an OpenAI HTTP API."""

__version__ = "0.1.0"
