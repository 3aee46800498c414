"""mlxkv: local LLM inference on MLX with a first-class KV-cache system."""
__version__ = "0.1.0"
