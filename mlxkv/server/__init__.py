"""``mlxkv serve``: an OpenAI-compatible HTTP server over the continuous-batching engine.

:func:`mlxkv.server.app.create_app` builds the FastAPI app around a :class:`~mlxkv.engine.batch.BatchEngine`;
:func:`mlxkv.server.runner.build` loads a model and wires everything; ``python -m mlxkv.server`` runs it.
"""
