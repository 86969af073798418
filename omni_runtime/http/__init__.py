"""`omni-runtime serve`: an OpenAI-compatible HTTP front end over the pipeline.

One more client of the orchestrators (one `OmniClient` per server process);
any number of server replicas can run against one Redis. `app.create_app` builds
the ASGI app, `serve.run_serve` runs it; nothing is imported here, so the command
line can declare the serve flags without loading the web stack.
"""
