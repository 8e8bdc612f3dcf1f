"""The optional compiled helper (router/native/: native.c, blocktable.c); everything else is in
pyproject.toml. When it cannot be built (no C compiler, no Python headers) the install
goes on without it and router/hashing.py uses its pure-Python path, which gives the same
keys."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "router._native",
            sources=["router/native/native.c", "router/native/blocktable.c"],
            depends=["router/native/xxhash.h"],
            include_dirs=["router/native"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
