"""Protocol definitions (.proto files) and their generated stubs."""
