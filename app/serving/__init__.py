"""Ray Serve hosting: the application `serve run` imports (builder.py), the Ingress deployment
hosting the FastAPI app, the LLMServer replica pool, and the EngineClient interface the API
talks to (over the pool, or an in-process engine)."""
