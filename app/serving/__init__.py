"""Ray Serve hosting: the application `serve run` imports (builder.py), its deployments (the
merged layout's ModelServer, or the split layout's Ingress in front of the LLMServer pool), a
replica's scheduler actor (replica.py), and the EngineClient interface the API talks to (a
replica's own scheduler, the pool through a handle, or an in-process engine)."""
