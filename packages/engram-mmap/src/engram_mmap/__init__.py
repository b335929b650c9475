"""engram-mmap: Engram n-gram hashing and the memory-mapped gather of Engram table rows."""

from importlib.metadata import version as _version

__version__ = _version("engram-mmap")
__all__ = ["__version__"]
