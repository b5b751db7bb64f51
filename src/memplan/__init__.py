"""memplan: plan the memory of PyTorch training and inference steps without changing their math."""

__version__ = "0.1.0"
