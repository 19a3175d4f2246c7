"""Kernel-level clauses (functions with the signature of `F.scaled_dot_product_attention`, or FlashAttention's API)
and the machinery only they use: the call contracts and their guards, declared and learned limits, coverage, the
drawn problems at tile scale, the FlashAttention oracle, the gradient oracle and the tail bounds of the
statistical clauses."""
