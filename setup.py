"""Build-time only: the transfer layer's compiled helper, built by the build backend at install.

Everything else about the package is in pyproject.toml.  The extension is optional: where no C
compiler or Python headers exist the install still succeeds, and ``transfer.native`` says once
(a log line) that moves take the Python path.  Nothing is ever compiled at run time.  OpenMP is
used where the compiler has it (the CPU copy then runs on torch's own OpenMP threads).
"""

from __future__ import annotations

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = Extension("stagecache.runtime.transfer._native", ["runtime/transfer/native.c"],
                   extra_compile_args=["-O2", "-pthread"], extra_link_args=["-pthread"])


class BuildExt(build_ext):
    """OpenMP first, then without it; a failed build leaves the package without the helper."""

    def build_extension(self, ext: Extension) -> None:
        base_compile, base_link = list(ext.extra_compile_args), list(ext.extra_link_args)
        for extra in (["-fopenmp"], []):
            ext.extra_compile_args, ext.extra_link_args = base_compile + extra, base_link + extra
            try:
                super().build_extension(ext)
                return
            except Exception as exc:  # noqa: BLE001 - any compiler failure: try the next flags
                error = exc
        print(f"stagecache: the compiled transfer helper was not built ({error}); "
              "transfers will run through numpy and Python")


setup(ext_modules=[NATIVE], cmdclass={"build_ext": BuildExt})
