"""A package, so that this directory's conftest.py loads as kernels.conftest: as a bare
`conftest` module it would replace tests/conftest.py in sys.modules, and the test modules
collected after it that do `from conftest import ...` would fail to import."""
