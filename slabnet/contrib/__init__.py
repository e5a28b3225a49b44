"""slabnet under other libraries.

Each submodule imports the library it serves; this package imports nothing,
so ``import slabnet`` never pulls in an optional dependency:

* ``slabnet.contrib.httpcore``: an ``httpcore.AsyncNetworkBackend`` whose
  streams are slabnet connections (``pip install 'slabnet[httpx]'``);
* ``slabnet.contrib.httpx``: ``AsyncSlabnetTransport``, an httpx transport
  over that backend.
"""
