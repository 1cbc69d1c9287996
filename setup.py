"""The optional compiled histogram kernel (qdqgraph/calib/_abshist.c); everything else is in
pyproject.toml. Without a C compiler the build goes on and calibration counts with numpy."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("qdqgraph.calib._abshist", ["qdqgraph/calib/_abshist.c"],
                              extra_compile_args=["-O3"], optional=True)])
