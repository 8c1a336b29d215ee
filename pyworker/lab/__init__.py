"""The tooling around the runtime: the bench and its take-outs, the eval and the LoCoMo loader,
the provenance checks, the replay adapter, the demo, the throwaway and embedded servers and the
release tools.

The worker, the client and the command line's runtime commands import none of it; the command
line imports it lazily inside ``pimem demo``, ``pimem eval``, ``pimem bench`` and
``pimem freeze-release``. The embedded server needs the ``demo`` extra
(``pip install 'pimem[demo]'``), the bench's peer and plot the ``bench`` extra.
"""
