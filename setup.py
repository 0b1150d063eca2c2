"""Packaging beyond pyproject.toml: kvbench-lm-eval.pth in the wheel and in the editable install.

The .pth makes lm-eval's own command line find the model "kvbench" and kvbench's packaged lm-eval tasks
(kvbench/commands/lm_eval_hook.py explains how; lm-eval 0.4.13 reads no plugin entry points). Everything else is in
pyproject.toml.
"""
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "kvbench-lm-eval.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithPth(build_py):
    """A regular wheel: the .pth next to the kvbench package in site-packages."""

    def run(self):
        super().run()
        shutil.copy(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


cmdclass = {"build_py": BuildPyWithPth}
try:
    from setuptools.command.editable_wheel import editable_wheel

    class EditableWheelWithPth(editable_wheel):
        """`pip install -e .`: the editable wheel carries the .pth beside setuptools' own __editable__ one."""

        def _select_strategy(self, *args, **kwargs):
            strategy = super()._select_strategy(*args, **kwargs)

            class WithPth:
                def __enter__(self):
                    strategy.__enter__()
                    return self

                def __exit__(self, *exc):
                    return strategy.__exit__(*exc)

                def __call__(self, wheel, files, mapping):
                    strategy(wheel, files, mapping)
                    with open(os.path.join(HERE, PTH)) as f:
                        wheel.writestr(PTH, f.read())

            return WithPth()

    cmdclass["editable_wheel"] = EditableWheelWithPth
except ImportError:  # pragma: no cover  (a setuptools without PEP 660 editable wheels)
    pass

setup(cmdclass=cmdclass)
