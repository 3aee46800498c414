"""GGUF files (llama.cpp's format) as mlx-lm models: loaded in place, or converted to a Hugging Face folder."""

from mlxkv.gguf.load import convert, load_gguf, translate
from mlxkv.gguf.reader import GGUFError, is_gguf

__all__ = ["GGUFError", "convert", "is_gguf", "load_gguf", "translate"]
