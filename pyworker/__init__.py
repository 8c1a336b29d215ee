"""pimem: long-term conversation memory for chat bots, inside PostgreSQL.

The database (``sql/``) is the product; this package is the courier: it migrates the schema,
runs the worker that makes the model calls, and offers the ``pimem`` command line.
"""

__version__ = "0.2.0.dev0"
