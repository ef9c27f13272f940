"""The HTTP API: the FastAPI app (app.py), its routes, middleware and errors, the per-request
context routes run engine requests through, and the server-side settings.

Kept empty of imports: app/config.py imports app.api.settings without loading FastAPI."""
