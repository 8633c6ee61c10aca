"""kvray: a distributed LLM serving cluster on Ray.

The repository root is this package; each code folder installs as a sub-package
(`kvray.engine` is `engine/`). See DESIGN.md for the map.
"""

__version__ = "0.1.0"
