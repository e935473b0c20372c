"""Every registered architecture offers the model contract the worker relies on
(``models/base.py``: ``CausalLM`` for a built model, ``ModelClass`` for the class)."""

from __future__ import annotations

import inspect

import pytest

from qwenserve.models.base import CausalLM, ModelClass
from qwenserve.models.registry import SUPPORTED_ARCHITECTURES, load_model_class


def _members(protocol: type) -> set[str]:
    names = set(vars(protocol)) | set(getattr(protocol, "__annotations__", {}))
    return {n for n in names if not n.startswith("_") or n == "__call__"} - {"__call__"}


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_architecture_offers_the_model_contract(architecture):
    cls = load_model_class(architecture)
    assert callable(getattr(cls, "cache_specs", None)), "ModelClass.cache_specs"
    for name in _members(ModelClass):
        assert hasattr(cls, name), (architecture, name)
    for name in _members(CausalLM) - {"lm_head"}:  # lm_head is an instance attribute
        assert callable(getattr(cls, name, None)), (architecture, name)
    # the worker calls these with exactly the protocol's parameters
    for name in ("compute_logits", "load_weights", "allocate_state"):
        want = list(inspect.signature(getattr(CausalLM, name)).parameters)
        assert list(inspect.signature(getattr(cls, name)).parameters) == want, (architecture, name)
    specs = inspect.signature(cls.cache_specs).parameters
    assert list(specs)[:3] == ["hf_config", "tp_size", "kv_dtype_bytes"], architecture


def test_models_without_recurrent_layers_allocate_no_state():
    import torch

    cls = load_model_class("Qwen2ForCausalLM")
    assert cls.allocate_state(object.__new__(cls), 4, torch.device("cpu")) == []


def test_lm_head_logits_in_float32_or_its_own_dtype():
    """``compute_logits`` widens to float32 by default; ``dtype=None`` (the sampling path) keeps
    the head's dtype, the same values before the widening."""
    import torch

    from qwenserve.layers.embedding import ParallelLMHead

    head = ParallelLMHead(50, 16, torch.bfloat16)
    torch.nn.init.normal_(head.weight)
    hidden = torch.randn(3, 16).bfloat16()
    wide, own = head.compute_logits(hidden), head.compute_logits(hidden, dtype=None)
    assert wide.dtype == torch.float32 and own.dtype == torch.bfloat16
    assert torch.equal(own.float(), wide)
