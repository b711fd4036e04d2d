"""``speclm serve``: an OpenAI-compatible HTTP server over the batched speculative engine.

Imports here stay light (the CLI builds its parser from :mod:`.launch`); the app, worker and
metrics modules pull in FastAPI and prometheus_client, from the ``serve`` extra.
"""
