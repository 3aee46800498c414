"""Offline test fixtures: tiny random-weight models of real mlx-lm architectures and a BPE tokenizer
trained on prose that ships with Python (``pydoc_data.topics``). Nothing here touches the network."""

from testkit.archs import ARCH_NAMES, ARCHITECTURES, build_model, get_config

__all__ = ["ARCH_NAMES", "ARCHITECTURES", "build_model", "get_config"]
