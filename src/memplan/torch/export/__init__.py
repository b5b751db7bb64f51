"""Exports a PyTorch user already knows how to open: memory snapshots for PyTorch's memory
visualizer, Chrome/Perfetto traces, selective-activation-checkpointing policies and a
``torch.compile`` backend, all made from memplan's plans."""
