"""Building blocks shared by every model family: projections, norms, MLPs, positions,
softmax attention with caches, and task heads."""
