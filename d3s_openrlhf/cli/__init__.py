"""Command-line entrypoints."""
