"""The C extensions (setuptools' stable way to declare them; the rest is in pyproject.toml).

``_step_values`` is plain C over the Python C API. ``_step_structure`` is C++ over torch's C++
API, so it is built only where torch is importable while building (``pip install
--no-build-isolation``, after torch: nox does this), against that torch, and is optional: where
it cannot be built, attnhub-speedups installs without it and attnhub checks a step's structure
in Python (docs/install.md).
"""

import sys

from setuptools import Extension, setup


def _step_structure() -> list[Extension]:
    try:
        import torch
        from torch.utils.cpp_extension import CppExtension
    except ImportError:
        print(
            "attnhub-speedups: torch is not importable in this build environment, so the "
            "structure pass (_step_structure) is not built; install with --no-build-isolation "
            "after torch to build it",
            file=sys.stderr,
        )
        return []
    return [
        CppExtension(
            "attnhub_speedups._step_structure",
            ["src/attnhub_speedups/_step_structure.cpp"],
            define_macros=[
                ("ATTNHUB_TORCH_VERSION", torch.__version__),
                ("_GLIBCXX_USE_CXX11_ABI", str(int(torch._C._GLIBCXX_USE_CXX11_ABI))),
            ],
            extra_compile_args=["-std=c++20", "-O2", "-g0"],  # (-g0: no 5 MB of debug info)
            optional=True,  # a failed build leaves the Python rules in charge, not a failed install
        )
    ]


setup(
    ext_modules=[
        Extension("attnhub_speedups._step_values", ["src/attnhub_speedups/_step_values.c"]),
        *_step_structure(),
    ]
)
