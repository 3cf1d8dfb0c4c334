"""Every tokenizer path in one place, for the router and the simulated engines alike.

* ``hf``: a local Hugging Face tokenizer and chat template (the router's local mode and the
  simulated engine both use it, so their ids agree);
* ``segments``: exact prompt ids from cached pieces, and ``piece_check``, the worker thread
  that re-checks them off the event loop;

The package sits at the shell's level of the rings (it reads files, logs and talks to
engines) but below ``shell``: it imports ``core``, ``wire``, ``config`` and ``http`` only.
The rough estimate that ``core`` uses (``core/tokens.py``) stays in ``core``, which is pure.
"""
