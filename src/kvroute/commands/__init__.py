"""Command groups of the ``kvroute`` CLI, one module each (assembled in ``kvroute.cli``)."""
