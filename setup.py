"""Extension building only; metadata lives in setup.cfg.

Builds the Cython CPU kernels (``distemb._kernels``) and, when ``nvcc`` is found, the
CUDA kernels in ``csrc/cuda`` as a plain shared library ``distemb/_cuda_kernels.so``
(an ``extern "C"`` API loaded with ctypes, so no torch CUDA toolchain is needed).
Environment switches: ``DISTEMB_NO_CUDA=1`` skips the CUDA build, ``DISTEMB_REQUIRE_CUDA=1``
turns a missing nvcc or a failed CUDA build into an error, ``NVCC`` names the compiler.
"""
import glob
import importlib.util
import logging
import os
import shutil
import subprocess
import sys

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# -fno-math-errno lets sqrtf vectorise; no -ffast-math: results must stay IEEE (torch's).
# -ffp-contract=off: the AVX2 and AVX-512 builds may use FMA instructions, but never fuse a
# multiply and an add of the source (that skips a rounding: other bits than torch's).
# No -march: the CPU kernels are built for baseline x86-64, AVX2 + FMA and AVX-512 and
# picked at run time (csrc/cpu_kernels.h), so a wheel runs on any x86-64 CPU at its best.
COMPILE_ARGS = ["-O3", "-g0", "-fno-math-errno", "-ffp-contract=off", "-fopenmp", "-std=c++17"]


def _generate_rule_glue():
    """Write csrc/gen/ (the per-rule entry points of every build) from the one rule table,
    distemb/kernels/rule_table.py, with csrc/codegen.py; returns the files it wrote."""
    spec = importlib.util.spec_from_file_location(
        "distemb_codegen", os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc",
                                        "codegen.py"))
    codegen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codegen)
    return [os.path.relpath(p) for p in codegen.generate()]


GENERATED = _generate_rule_glue()
RULE_DEPENDS = ["csrc/rules.h", "distemb/kernels/rule_table.py", "csrc/codegen.py"] + GENERATED

CUDA_SOURCES = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
CUDA_DEPENDS = CUDA_SOURCES + sorted(glob.glob(os.path.join("csrc", "cuda", "*.*h"))) + \
    RULE_DEPENDS
CUDA_LIB = os.path.join("distemb", "_cuda_kernels.so")
NVCC_FLAGS = [
    "-O3", "-std=c++17", "-shared", "-cudart", "static",
    # Unfused float arithmetic keeps results bitwise equal to the CPU kernels.
    "-fmad=false",
    "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
    # Hide the static cudart's symbols so they cannot clash with torch's libcudart.
    "-Xlinker", "--exclude-libs=ALL",
    "-gencode", "arch=compute_80,code=sm_80",
    "-gencode", "arch=compute_90,code=sm_90",
    "-gencode", "arch=compute_90,code=compute_90",  # PTX, JIT-compiled on newer GPUs
    "--threads", "0",  # the targets side by side, a thread per CPU (the same library)
]


def _flag(name):
    return os.environ.get(name, "") not in ("", "0")


def _find_nvcc():
    explicit = os.environ.get("NVCC")
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise OSError(f"NVCC={explicit} is not an executable file")
        return explicit
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.access(nvcc, os.X_OK):
        raise OSError("nvcc not found (put the CUDA toolkit's bin on PATH or set NVCC)")
    return nvcc


class BuildExtWithCuda(build_ext):
    """build_ext that also compiles the CUDA library with nvcc, while the Cython
    extensions compile (those side by side too, one per CPU)."""

    def finalize_options(self):
        """Compile the extensions in parallel unless ``--parallel`` says otherwise."""
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def run(self):
        """Start the CUDA build when wanted, build the Cython extensions, then wait for
        the CUDA build."""
        nvcc = None if _flag("DISTEMB_NO_CUDA") else self._start_cuda()
        try:
            super().run()
        except BaseException:
            if isinstance(nvcc, subprocess.Popen):
                nvcc.kill()
                nvcc.wait()
            raise
        if _flag("DISTEMB_NO_CUDA"):
            self.announce("DISTEMB_NO_CUDA set: skipping the CUDA kernels", level=logging.INFO)
        elif isinstance(nvcc, OSError):
            self._cuda_failed(str(nvcc), nvcc)
        elif nvcc is not None and nvcc.wait() != 0:
            self._cuda_failed(f"{nvcc.args[0]} exited with status {nvcc.returncode}, see "
                              "its messages above",
                              subprocess.CalledProcessError(nvcc.returncode, nvcc.args))

    def _cuda_failed(self, reason, exc):
        if _flag("DISTEMB_REQUIRE_CUDA"):
            raise RuntimeError(f"DISTEMB_REQUIRE_CUDA=1 but the CUDA build failed: {reason}") \
                from exc
        sys.stderr.write(f"WARNING: distemb CUDA kernels not built ({reason}); the CPU "
                         "kernels are installed and CUDA tables will be unavailable. "
                         "Set DISTEMB_NO_CUDA=1 to silence this.\n")

    def get_outputs(self):
        """Return the Cython outputs plus the CUDA library when it was built."""
        outputs = super().get_outputs()
        target = self._cuda_target()
        return outputs + [target] if os.path.exists(target) else outputs

    def _cuda_target(self):
        # In place for `build_ext --inplace` and editable installs, else in build_lib.
        return CUDA_LIB if self.inplace else os.path.join(self.build_lib, CUDA_LIB)

    def _start_cuda(self):
        """nvcc started on the CUDA sources (a Popen); None where the library is up to
        date; the OSError where nvcc cannot be found or started."""
        target = self._cuda_target()
        try:
            nvcc = _find_nvcc()
            if not self.force and os.path.exists(target) and all(
                    os.path.getmtime(src) <= os.path.getmtime(target) for src in CUDA_DEPENDS):
                self.announce(f"{target} is up to date", level=logging.INFO)
                return None
            os.makedirs(os.path.dirname(target), exist_ok=True)
            cmd = [nvcc, *NVCC_FLAGS, "-o", target, *CUDA_SOURCES]
            self.announce("compiling CUDA kernels: " + " ".join(cmd), level=logging.INFO)
            return subprocess.Popen(cmd)
        except OSError as exc:
            return exc


extensions = [
    Extension(
        "distemb._kernels",
        ["csrc/_kernels.pyx"],
        include_dirs=["csrc"],
        # the kernels are csrc/cpu_kernels.h: a baseline, an AVX2 and an AVX-512 build of
        # each, picked at run time (no -m flags here)
        depends=["csrc/cpu_kernels.h", "csrc/cpu_kernels_body.h"] + RULE_DEPENDS,
        extra_compile_args=COMPILE_ARGS,
        extra_link_args=["-fopenmp"],
        language="c++",
    ),
    Extension(
        "distemb._halfkernels",
        ["csrc/_halfkernels.pyx"],
        include_dirs=["csrc"],
        # a baseline, an AVX2 + FMA + F16C and an AVX-512 build of each kernel, picked
        # at run time by the CPU that runs them (csrc/cpu_kernels.h): no -m flags here
        depends=["csrc/cpu_kernels.h", "csrc/cpu_kernels_body.h"] + RULE_DEPENDS,
        extra_compile_args=COMPILE_ARGS,
        extra_link_args=["-fopenmp"],
        language="c++",
    ),
    Extension(
        "distemb._skipgram",
        ["csrc/_skipgram.pyx"],
        extra_compile_args=COMPILE_ARGS,
        language="c++",
    ),
    Extension(
        "distemb._cachebook",
        ["csrc/_cachebook.pyx"],
        extra_compile_args=COMPILE_ARGS,
        language="c++",
    ),
    Extension(
        "distemb._hashtable",
        ["csrc/_hashtable.pyx"],
        extra_compile_args=COMPILE_ARGS,
        language="c++",
    ),
]

setup(
    ext_modules=cythonize(extensions, compiler_directives={"language_level": 3},
                          include_path=["csrc"], nthreads=os.cpu_count() or 1),
    cmdclass={"build_ext": BuildExtWithCuda},
)
