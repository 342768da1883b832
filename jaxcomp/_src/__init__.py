"""jaxcomp internals. The public API is what ``jaxcomp/__init__.py`` exports."""
