"""Neural-network parts written with einops: the attention kernel, multi-head attention, feed-forward,
norms, positional schemes, embeddings, encoder/decoder blocks and the three model families."""
