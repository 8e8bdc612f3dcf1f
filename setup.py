"""The optional compiled helper (router/native/: native.c, blocktable.c, cost.c,
latency.c); everything else is in pyproject.toml. When it cannot be built (no C
compiler, no Python headers) the install goes on without it and router/hashing.py uses
its pure-Python path, which gives the same keys."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "router._native",
            sources=[
                "router/native/native.c",
                "router/native/blocktable.c",
                "router/native/cost.c",
                "router/native/latency.c",
            ],
            depends=["router/native/xxhash.h"],
            include_dirs=["router/native"],
            # -ffp-contract=off: no fused multiply-adds, so the float arithmetic of cost.c
            # and latency.c is Python's, operation for operation (ties and choices agree)
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        )
    ]
)
