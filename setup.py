"""pyproject.toml describes the package; this shim only lets tools that still run setup.py build it."""

from setuptools import setup

setup()
