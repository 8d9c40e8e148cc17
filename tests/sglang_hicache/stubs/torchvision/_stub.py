"""A stand-in for torchvision in the SGLang contract tests' venv (see ../../conftest.py).

`sglang.srt.mem_cache.memory_pool` imports `sglang.srt.configs`, which imports the multimodal
processors, which import torchvision at module level; transformers then asks torchvision's
version. No torchvision build on the package registry matches the CPU wheel of torch 2.13.0
(the registry's builds are CUDA ones: they fail at import on CPU torch), and the storage path
never transforms an image. So this package answers the names those modules look up at import,
and any use of them raises.
"""

import enum


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BOX = "box"
    HAMMING = "hamming"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision is a stand-in here (tests/sglang_hicache/stubs)")


def make_getattr(modname):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":
            return InterpolationMode
        return type(name, (_Unavailable,), {"__module__": modname})

    return __getattr__
