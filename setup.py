"""Extension building only; metadata lives in setup.cfg."""
import os

from Cython.Build import cythonize
from setuptools import Extension, setup

# -fno-math-errno lets sqrtf vectorise; no -ffast-math: results must stay IEEE (torch's).
COMPILE_ARGS = ["-O3", "-fno-math-errno", "-fopenmp", "-std=c++17"]
if os.environ.get("DISTEMB_NATIVE") == "1":
    COMPILE_ARGS.append("-march=native")

extensions = [
    Extension(
        "distemb._kernels",
        ["csrc/_kernels.pyx"],
        extra_compile_args=COMPILE_ARGS,
        extra_link_args=["-fopenmp"],
        language="c++",
    )
]

setup(ext_modules=cythonize(extensions, compiler_directives={"language_level": 3}))
