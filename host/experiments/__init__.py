"""Experiments: drivers, studies, benchmarks and plots built on the library. No library module imports from here."""
