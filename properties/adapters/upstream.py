"""``--reference upstream``: transformers' own implementation of the model under test, from the same config, with the
same weights — the reference of a reimplementation (a serving engine's Gemma 3, a port to another framework, a model
with a changed kernel), one flag instead of a factory::

    pytest properties/ -m model --model my_port.py:gemma3 --reference upstream
    pytest properties/ -m model --model my_port.py:gemma3 --reference upstream --reference-map my_port.py:NAMES

The model under test must carry a transformers config (``Subject.module.config``, a ``PretrainedConfig``). Its class,
when it is one of transformers' own, is built again from that config; otherwise the config's ``architectures[0]``, else
the Auto class of the subject's kind. Its weights are loaded by name (``state_dict``), or through ``--reference-map``:
a dict {upstream name: name in the model under test} or a callable from the subject's state dict to upstream's. A
weight upstream needs and does not get is a one-line error naming it.
"""
from __future__ import annotations

import copy

from properties.adapters.huggingface import hf_subject, require_transformers
from properties.core.subject import Subject, SubjectError

__all__ = ["upstream_reference", "UPSTREAM"]

UPSTREAM = "upstream"
AUTO = {"decoder_only": "AutoModelForCausalLM", "encoder_decoder": "AutoModelForSeq2SeqLM",
        "encoder_only": "AutoModel"}


def _model_class(subject: Subject, config, transformers):
    own = type(subject.module)
    if own.__module__.startswith("transformers.") and getattr(transformers, own.__name__, None) is own:
        return own, f"transformers' {own.__name__}"
    for name in getattr(config, "architectures", None) or ():
        if isinstance(getattr(transformers, name, None), type):
            return getattr(transformers, name), f"transformers' {name} (the config's architectures)"
    auto = getattr(transformers, AUTO[subject.kind])
    return (lambda c: auto.from_config(c)), f"{AUTO[subject.kind]}.from_config"


def _mapped(state: dict, mapping) -> dict:
    if mapping is None:
        return state
    if callable(mapping):
        mapped = mapping(state)
        if not isinstance(mapped, dict):
            raise SubjectError(f"--reference-map: the callable returned {type(mapped).__name__}; expected a dict of "
                               f"upstream parameter names to tensors")
        return mapped
    if isinstance(mapping, dict):
        unknown = [name for name in mapping.values() if name not in state]
        if unknown:
            raise SubjectError(f"--reference-map: {len(unknown)} name(s) are not weights of the model under test "
                               f"({', '.join(unknown[:3])})")
        return {**{k: v for k, v in state.items() if k not in set(mapping.values())},
                **{upstream: state[name] for upstream, name in mapping.items()}}
    raise SubjectError(f"--reference-map: a {type(mapping).__name__}; expected a dict {{upstream name: name}} or a "
                       f"callable(state_dict) -> state_dict")


def upstream_reference(subject: Subject, mapping=None) -> Subject:
    """The Subject of transformers' implementation of ``subject``'s config, carrying ``subject``'s weights."""
    transformers = require_transformers()
    config = getattr(subject.module, "config", None)
    if not isinstance(config, transformers.PretrainedConfig):
        raise SubjectError("--reference upstream: the model under test carries no transformers config "
                           "(Subject.module.config is not a PretrainedConfig); name a reference with --reference "
                           "FILE.py:FACTORY")
    make, what = _model_class(subject, config, transformers)
    parameter = next((p for p in subject.module.parameters() if p.is_floating_point()), None)
    model = make(copy.deepcopy(config))
    if parameter is not None:
        model = model.to(parameter.device, parameter.dtype)
    state = _mapped(subject.module.state_dict(), mapping)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {name for name in missing if "lm_head" in name or "embed" in name} if getattr(
        config, "tie_word_embeddings", False) else set()
    missing = [name for name in missing if name not in tied]
    if missing:
        raise SubjectError(f"--reference upstream: {what} needs {len(missing)} weight(s) the model under test does not "
                           f"have by that name ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); pass "
                           f"--reference-map FILE.py:NAMES (a dict {{upstream name: your name}} or a callable)")
    if unexpected:
        raise SubjectError(f"--reference upstream: {len(unexpected)} weight(s) of the model under test have no place "
                           f"in {what} ({', '.join(unexpected[:3])}{', ...' if len(unexpected) > 3 else ''}); pass "
                           f"--reference-map FILE.py:NAMES")
    if tied and hasattr(model, "tie_weights"):
        model.tie_weights()
    # the reference's own MODEL-GRADIENT never runs: parameters its forward leaves unreached are no reason to stop
    return hf_subject(model.eval(), kind=subject.kind, pad_id=subject.pad_id, max_len=subject.max_len,
                      unused_parameters="unreached")
