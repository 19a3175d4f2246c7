"""MODEL-PRECISION (SPEC.md, "Models"): a model computes in the precision it declares. A float32 or float64 model
(its float64 twin included) that computes anything in 16 bits inside fails, naming the module and the dtype seen;
float32 islands of a float64 model (transformers' rotary tables, softmax and norm statistics) are allowed and named in
the report. The suite's bounds follow the declared dtype (properties/model/precision.py: ``allowed_dtypes``), so a
16-bit island can never widen them: without this clause it would pass unseen."""
from __future__ import annotations

import pytest

from properties import clause
from properties.model.precision import precision_of
from properties.model.twin import ISLANDS, add_note


def _dtype(d) -> str:
    return str(d).removeprefix("torch.")


@clause("MODEL-PRECISION")
def test_model_computes_in_the_precision_it_declares(mut):
    checked = []
    subjects = [("the model as built", mut.native)] + ([("its float64 twin", mut.precise)]
                                                       if mut.precise is not mut.native else [])
    for who, s in subjects:
        precision = precision_of(s)
        if precision is None or precision.declared is None:
            continue
        checked.append(who)
        if precision.narrow:
            first = precision.narrow[0]
            more = f" (and {len(precision.narrow) - 1} more module(s): " + ", ".join(
                n.module for n in precision.narrow[1:4]) + ")" if len(precision.narrow) > 1 else ""
            raise AssertionError(
                f"{who} declares {_dtype(precision.declared)} but computes in {_dtype(first.dtype)} inside "
                f"{first.module}: {first.operation} gives or reads {_dtype(first.dtype)} ({first.count} operation(s))"
                f"{more}; a {_dtype(precision.declared)} model must not compute in 16 bits, and the suite's bounds stay "
                f"those of {_dtype(precision.compute_dtype)}")
        if precision.islands:   # by class: every layer's norm is one island
            classes = sorted({n.module.rsplit(" (", 1)[-1].rstrip(")") for n in precision.islands})
            add_note(f"{ISLANDS}{', '.join(classes)}")
    if not checked:
        pytest.skip("Subject.module is None: the precision a model declares is its parameters' dtype")
