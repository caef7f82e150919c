"""Builds fastagg's compiled CPU kernels (C++17, OpenMP, pybind11; no torch headers) twice from the same sources:
``fastagg._C`` (portable x86-64 / any architecture) and, on x86-64, ``fastagg._C_avx2`` (-mavx2 -mfma), chosen at
import time by the CPU's capability like torch's own kernels are (measured ~20% faster local steps on AVX2).

And, where torch is importable while building (``pip install --no-build-isolation``, as ``make`` installs),
``fastagg._tensor_facts`` (csrc/tensor_facts.cpp): the per-entry checks of a many-entry round read from the tensors'
TensorImpls in one call. It is built against that torch's headers and stamped with its version; fastagg uses it only
under the same torch (fastagg/_facts.py). Where torch is not importable (an isolated wheel build) it is left out and
the same checks run in Python: the kernels' modules stay independent of the torch version."""
import copy
import glob
import os
import platform

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import Extension, setup

# Each module's sources compile in parallel too (one per core; FASTAGG_BUILD_JOBS=n sets n): the modules build side
# by side below, but the sanitized build is one module.
ParallelCompile("FASTAGG_BUILD_JOBS").install()

SOURCES = ["csrc/bindings.cpp", "csrc/round_stats.cpp", "csrc/server_apply.cpp", "csrc/local_step.cpp",
           "csrc/robust.cpp", "csrc/noise.cpp",
           "csrc/quantized.cpp"]
# Every source includes these: a changed header rebuilds the modules (setuptools compares them with the built .so;
# without them `pip install .` relinked stale objects). MANIFEST.in ships them in the sdist.
HEADERS = sorted(glob.glob("csrc/*.h"))


def extension(name, isa_flags):
    return Pybind11Extension(
        f"fastagg.{name}",
        SOURCES,
        depends=HEADERS,
        cxx_std=17,
        define_macros=[("FASTAGG_MODULE", name)],
        extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno", *isa_flags],
        extra_link_args=["-fopenmp"],
    )


ext_modules = [extension("_C", [])]
if platform.machine().lower() in ("x86_64", "amd64"):
    ext_modules.append(extension("_C_avx2", ["-mavx2", "-mfma"]))
if os.environ.get("FASTAGG_SANITIZE"):  # `make test-asan`: only the sanitized module, picked by FASTAGG_CPU_ISA=asan
    sanitize = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g"]
    ext_modules = [extension("_C_asan", ["-O1", *sanitize])]
    ext_modules[0].extra_link_args += sanitize

def tensor_facts_extension():
    """fastagg._tensor_facts against the torch this build sees, or None (with the reason printed) without one."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:
        print(f"fastagg: torch is not importable here ({e}); fastagg._tensor_facts is not built and the per-entry "
              "checks of a round run in Python (install with `pip install --no-build-isolation` to build it)")
        return None
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return Extension(
        "fastagg._tensor_facts",
        ["csrc/tensor_facts.cpp"],
        include_dirs=cpp_extension.include_paths(),
        library_dirs=cpp_extension.library_paths(),
        libraries=["c10", "torch", "torch_cpu", "torch_python"],
        define_macros=[("FASTAGG_TORCH_VERSION", f'"{torch.__version__}"'),
                       ("FASTAGG_TORCH_GIT_VERSION", f'"{torch.version.git_version}"'),
                       ("_GLIBCXX_USE_CXX11_ABI", str(abi)), ("TORCH_API_INCLUDE_EXTENSION_H", None)],
        extra_compile_args=["-O2", "-std=c++20", "-fvisibility=hidden", "-w"],  # (torch's headers warn a lot)
        language="c++",
        # a torch whose headers it does not compile against must not fail the install: fastagg then checks in Python
        # (tests/test_tensor_facts.py fails where `make` installed without it)
        optional=True,
    )


if not os.environ.get("FASTAGG_SANITIZE") and (facts := tensor_facts_extension()) is not None:
    ext_modules.append(facts)


class BuildExt(build_ext):
    """The modules build in parallel (one per core). Both compile the same sources with different flags, so each
    gets its own object directory: neither can link the other's objects."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = min(len(self.extensions), os.cpu_count() or 1)  # one module per core

    def build_extension(self, ext):
        own = copy.copy(self)  # the threads of a parallel build share self: never mutate it
        own.build_temp = os.path.join(self.build_temp, ext.name)
        build_ext.build_extension(own, ext)


setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildExt})
