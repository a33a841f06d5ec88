"""pagefleet: shared small pieces (version, block hashing) and the CLI entry point."""

__version__ = "0.1.0"
