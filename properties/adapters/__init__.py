"""Adapters: other libraries' models as suite Subjects (properties/core/subject.py).

``hf_subject(model)``: a Hugging Face transformers model, its Subject read from its config. The import
of transformers happens when it is called, so ``properties`` works without it.
``python -m properties.adapters.conformance``: the model clauses over the architectures of
examples/conformance.py, as a table.
"""
from __future__ import annotations

from properties.adapters.huggingface import hf_subject, require_transformers

__all__ = ["hf_subject", "require_transformers"]
