"""pagefleet: shared small pieces (version, block hashing) and the CLI entry point."""

from pkgutil import extend_path

__version__ = "0.1.0"

# From a source checkout's root, this folder shadows the installed package, whose subpackages
# (engine, router, ...) live in other folders. Joining every `pagefleet/` on sys.path keeps
# `python -m pagefleet` and `python -c "import pagefleet.engine"` working there.
__path__ = extend_path(__path__, __name__)
