# The package version's single source: pyproject.toml reads this line
# statically at build time (so building needs neither torch nor CuPy), and
# cupy_fused re-exports it as cupy_fused.__version__.
__version__ = "0.1.0"
