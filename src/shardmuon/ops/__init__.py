"""The math, on plain local tensors: no ``torch.distributed``, no planning.

``newton_schulz`` (the orthogonalization and its presets), ``update`` (momentum, lr
scaling, the Muon update), ``adamw`` (dion's AdamW arithmetic), ``partitions`` (fused
weights cut into blocks that are orthogonalized on their own).
"""
