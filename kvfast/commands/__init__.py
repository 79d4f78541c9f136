"""Subcommands of the ``kvfast`` command line (see :mod:`kvfast.cli`)."""
