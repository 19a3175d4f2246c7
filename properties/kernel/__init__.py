"""Kernel-level clauses: functions with the signature of `F.scaled_dot_product_attention`."""
