"""Vision-language models: images in prompts, with image-aware prefix caching (see docs/vision.md).

- :mod:`~mlxkv.vision.support`: which models take images; whether the ``vision`` extra (mlx-vlm) is installed.
- :mod:`~mlxkv.vision.images`: image inputs (data URLs, base64, allowed local files) decoded, checked and hashed.
- :mod:`~mlxkv.vision.encoder`: mlx-vlm's vision tower and projector, with a feature cache per content hash.
- :mod:`~mlxkv.vision.prompt`: image markers expanded to placeholder tokens; each image's cache key.
- :mod:`~mlxkv.vision.spans`: what the engine reads: image spans, their hash keys and input embeddings.
- :mod:`~mlxkv.vision.inputs`: one entry point for the doors (serve, generate, chat).
"""
