"""What a hit is worth to an engine on a real model (CPU): layer-wise load vs serial (`overlap`), fetch vs
recompute (`crossover`), KV checkpoint policies (`checkpoint`)."""
