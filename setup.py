"""Build accel's Cython core (accel._core) against the kernel ABI headers in include/accel,
and install the ACCEL_EAGER start-up hook (accel-eager.pth)."""
import os

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPy(build_py):
    """Also ship include/accel (generated kernels include it) and the .pth start-up hook."""

    def run(self):
        super().run()
        dst = os.path.join(self.build_lib, "accel", "include", "accel")
        os.makedirs(dst, exist_ok=True)
        for name in os.listdir(os.path.join(HERE, "include", "accel")):
            self.copy_file(os.path.join(HERE, "include", "accel", name), os.path.join(dst, name))
        self.copy_file(os.path.join(HERE, "accel-eager.pth"),
                       os.path.join(self.build_lib, "accel-eager.pth"))

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [
            os.path.join(self.build_lib, "accel-eager.pth")]


class EditableWheel(editable_wheel):
    """``pip install -e .`` gets the start-up hook too."""

    def _install_namespaces(self, installation_dir, pth_prefix):
        super()._install_namespaces(installation_dir, pth_prefix)
        self.copy_file(os.path.join(HERE, "accel-eager.pth"),
                       os.path.join(installation_dir, "accel-eager.pth"))


setup(
    ext_modules=cythonize(
        [Extension("accel._core", ["accel/_core.pyx"], include_dirs=["include"],
                   depends=["accel/_launch.pxi"])],
        compiler_directives={"language_level": "3"},
    ),
    cmdclass={"build_py": BuildPy, "editable_wheel": EditableWheel},
)
