"""The C extension (setuptools' stable way to declare one; the rest is in pyproject.toml)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("attnhub_speedups._step_values", ["src/attnhub_speedups/_step_values.c"])
    ]
)
