"""Engine objects given to ``check_cache`` as they are (:func:`kvfast.check.engines.engine_adapter`): which adapter
takes which object, tested with stand-in objects of the engines' own class names, no engine installed."""

from __future__ import annotations

import sys
import types

import pytest

from kvfast.check import check_cache
from kvfast.check.engines import engine_adapter
from kvfast.check.engines.llamacpp import llama_settings


def _stand_in(module: str, name: str, **attrs):
    """An instance of a class called ``name`` defined in module ``module`` (an engine's own naming)."""
    cls = type(name, (), {"__module__": module, **attrs})
    return cls()


_TL = "kvfast.check.engines.transformer_lens.TLModel"


def _subclass_of(obj):
    """An instance of a subclass of ``obj``'s class, defined in the user's own module."""
    return type("MyTransformer", (type(obj),), {"__module__": "mypackage"})()


def _llama(type_k: int = 1, path: str = "/models/tiny.gguf"):
    return _stand_in(
        "llama_cpp.llama", "Llama", model_path=path, context_params=types.SimpleNamespace(type_k=type_k),
        n_ctx=lambda self: 512,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("obj", "adapter"),
    [
        (_stand_in("onnxruntime_genai.onnxruntime_genai", "Model"), "kvfast.check.engines.ort.ORTModel"),
        (_llama(), "kvfast.check.engines.llamacpp.LlamaCppModel"),
        (_stand_in("vllm.entrypoints.llm", "LLM"), "kvfast.check.engines.vllm.VLLMModel"),
        (_stand_in("transformer_lens.HookedTransformer", "HookedTransformer"), _TL),
        (_subclass_of(_stand_in("transformer_lens.HookedTransformer", "HookedTransformer")), _TL),  # a user's own
        (_stand_in("transformer_lens.model_bridge.bridge", "TransformerBridge"), f"{_TL[:-7]}TLBridgeModel"),
    ],
)
def test_each_engine_object_finds_its_adapter(obj, adapter):
    name, cls = engine_adapter(obj)
    assert name == adapter and f"{cls.__module__}.{cls.__name__}" == adapter


def test_other_objects_of_the_same_class_names_are_no_engine():
    for obj in (_stand_in("mypackage", "Model"), _stand_in("mypackage", "Llama"), _stand_in("mypackage", "LLM"), 3,
                _stand_in("mypackage", "HookedTransformer"), _stand_in("mypackage", "TransformerBridge")):  # fmt: skip
        assert engine_adapter(obj) is None


def test_kvfast_check_takes_a_factory_that_returns_an_engine_object():
    from kvfast.commands.check import require_model_under_test

    require_model_under_test(_stand_in("vllm.entrypoints.llm", "LLM"), "make()")
    require_model_under_test(_stand_in("transformer_lens.HookedTransformer", "HookedTransformer"), "make()")
    with pytest.raises(ValueError, match=r"^the factory make\(\) returns no model under test"):  # the control
        require_model_under_test(_stand_in("mypackage", "HookedTransformer"), "make()")


def test_a_llama_object_gives_its_file_cache_type_and_context_length():
    assert llama_settings(_llama(type_k=1)) == {"path": "/models/tiny.gguf", "cache": "f16", "n_ctx": 512}
    assert llama_settings(_llama(type_k=0))["cache"] == "f32"
    assert llama_settings(_llama(type_k=8))["cache"] == "q8_0"
    with pytest.raises(ValueError, match=r"^model\.context_params\.type_k: 2 is not allowed; allowed: 0 \(f32\)"):
        llama_settings(_llama(type_k=2))  # q4_0: not a cache type kvfast knows the format of


def test_check_cache_hands_a_llama_object_to_its_adapter(tmp_path, monkeypatch):
    """Without llama-cpp-python the adapter says what to install; with it, the object's file is opened."""
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as where it is not installed
    with pytest.raises(ValueError, match=r"^model: a llama\.cpp model needs llama_cpp; allowed: pip install"):
        check_cache(_llama(path=str(gguf)), [1, 2, 3], 4)
    with pytest.raises(ValueError, match=r"^path: .* is not allowed; allowed: a GGUF file"):
        check_cache(_llama(path=str(tmp_path / "missing.gguf")), [1, 2, 3], 4)


def test_a_config_on_transformer_lens_4_is_one_clear_error(tmp_path, monkeypatch):
    """TransformerLens 4.0 removed HookedTransformer: its module raises ImportError for the name (as here)."""
    pytest.importorskip("torch")
    from kvfast.check.engines.transformer_lens import TLModel

    def removed(name):
        if name in ("HookedTransformer", "HookedTransformerConfig"):
            raise ImportError(f"{name!r} was removed in TransformerLens 4.0.")
        raise AttributeError(name)

    four = types.ModuleType("transformer_lens")
    four.__getattr__ = removed
    monkeypatch.setitem(sys.modules, "transformer_lens", four)
    config = tmp_path / "tiny.json"
    config.write_text('{"n_layers": 1}')
    with pytest.raises(ValueError, match=r"^transformer_lens: '.*' is not allowed; allowed: a release with HookedTr"):
        TLModel(config)
    monkeypatch.setitem(sys.modules, "transformer_lens", None)  # none installed: what to install
    with pytest.raises(ValueError, match=r"^model: a TransformerLens model needs transformer_lens; allowed: pip"):
        TLModel(config)
