"""slabnet's benchmark suite: ``python -m benchmarks --help``.

See benchmarks/README.md.  The package root imports nothing heavy: worker
processes import it too.
"""
