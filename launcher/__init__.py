"""The `pagedserve` command: serves a model (router, worker, or both as one program) or talks to a server."""
