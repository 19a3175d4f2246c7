"""Neural-network parts written with einops: the attention kernel, multi-head attention, its KV caches and packed
rows, feed-forward, norms, positional schemes, embeddings, encoder/decoder blocks and the three model families."""
