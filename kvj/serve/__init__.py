"""``kvj serve``: vLLM's own OpenAI-compatible server whose replies survive ``kill -9`` and power loss.

One concept per module: ``cli`` (parse and launch), ``plugin`` (vLLM's endpoint-plugin hook),
``determinism`` (events as a function of the tokens), ``engine`` (the one choke point into the
engine), ``replies`` (the reply journal), ``retention`` (held replies' lifetime), ``routes`` (the
HTTP surface), ``frames`` (SSE framing and polls), ``restore`` (the start-up join), ``shm``
(``/dev/shm`` left by a killed server), ``paths`` (files inside the journal directory).
Importing this package imports nothing else (the connector reads ``paths`` without vLLM).
"""
