"""The torch edge of memplan: capture, measurement, the model zoo, the runtime."""
