"""pip install ./torch_ext — builds the Rust library and the op library through the project's
top-level CMake (the same build ctest uses) and installs them inside the `fsdpturbo` package.

Needs cargo, cmake and a C++20 compiler, and torch already installed in the target
environment (use `pip install --no-build-isolation ./torch_ext`).
"""
import os
import pathlib
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent


def cargo_version():
    """The package version: Cargo.toml's [package] version, its one source."""
    text = (REPO / "Cargo.toml").read_text()
    package = text.split("[package]", 1)[1].split("\n[", 1)[0]
    return re.search(r'^version\s*=\s*"([^"]+)"', package, flags=re.M).group(1)


class BuildWithCMake(build_py):
    def run(self):
        super().run()
        build_dir = pathlib.Path(os.environ.get("FSDPTURBO_CMAKE_BUILD_DIR", REPO / "build"))
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.check_call(["cmake", "-S", str(REPO), "-B", str(build_dir), *generator,
                               "-DCMAKE_BUILD_TYPE=Release", f"-DPython3_EXECUTABLE={sys.executable}"])
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "fsdpturbo_torch"])
        lib_dir = pathlib.Path(self.build_lib) / "fsdpturbo" / "lib"
        shutil.rmtree(lib_dir, ignore_errors=True)  # nothing stale from an earlier build
        lib_dir.mkdir(parents=True)
        # One copy of the core, under its SONAME: the op library finds it so through $ORIGIN, and
        # fsdpturbo/_native.py loads it by that name.
        shutil.copy2(REPO / "target" / "release" / "libfsdpturbo.so", lib_dir / "libfsdpturbo.so.0")
        shutil.copy2(build_dir / "torch_ext" / "libfsdpturbo_torch.so", lib_dir / "libfsdpturbo_torch.so")


setup(
    name="fsdpturbo",
    version=cargo_version(),
    description="Expert-parallel and expert-sharded-FSDP engine for Mixture-of-Experts training",
    package_dir={"": "python"},
    packages=find_packages("python"),  # every package under python/, so a new subpackage cannot be left out
    python_requires=">=3.10",
    cmdclass={"build_py": BuildWithCMake},
    zip_safe=False,
)
