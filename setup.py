"""Builds fastagg's one compiled module, fastagg._C (C++17, OpenMP, pybind11; no torch headers)."""
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "fastagg._C",
            ["csrc/bindings.cpp", "csrc/round_stats.cpp", "csrc/server_apply.cpp", "csrc/local_step.cpp"],
            cxx_std=17,
            extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno"],
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": build_ext},
)
