"""``specwise serve``: an OpenAI-compatible server over :func:`specwise.generate` (docs/serve.md).

:func:`~specwise.serve.app.create_app` builds the FastAPI app for a loaded target;
:mod:`~specwise.serve.worker` runs generations one at a time off the event loop;
:mod:`~specwise.serve.protocol` holds the OpenAI request/response shapes. Needs the ``[serve]`` extra.
"""
