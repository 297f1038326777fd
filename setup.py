"""The native data path's build (homagg/native): pyproject.toml holds everything else.

Optional: where no C compiler is found, homagg installs without it and its Python engines run
(homagg.native says so). The library is plain C with no Python header (homagg.native loads it
with ctypes), so the build needs a C compiler and libc's headers alone, and downloads nothing.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "homagg.native._homagg_native",
    sources=["homagg/native/soft_loop.c", "homagg/native/agent_loop.c",
             "homagg/native/codec.c", "homagg/native/union.c", "homagg/native/sketch.c"],
    depends=["homagg/native/wire.h"],
    extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-fvisibility=default"],
    libraries=["pthread"],
    optional=True,
)])
