"""One module per CLI command; each defines ``register(app: typer.Typer)``."""
