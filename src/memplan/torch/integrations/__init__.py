"""Ways in from the frameworks people train with: HF Trainer, Accelerate, Lightning.

Each lives in its own module and imports its framework lazily, so memplan needs none of them.
"""
