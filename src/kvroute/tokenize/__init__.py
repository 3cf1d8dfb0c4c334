"""Every tokenizer path in one place, for the router and the simulated engines alike.

* ``prompt``: the router's per-pool ``PromptTokenizer`` (engine ``/tokenize``, local, switching)
  and ``check``, which verifies a local tokenizer against the engines and resolves ``auto``;
  ``ports`` names what both need from the shell (replicas, metrics) as protocols;
* ``hf``: a local Hugging Face tokenizer and chat template (the router's local mode and the
  simulated engine both use it, so their ids agree);
* ``segments``: exact prompt ids from cached pieces, and ``piece_check``, the worker thread
  that re-checks them off the event loop;
* ``sim_vocab``: the simulated engine's tokenizers (built-in vocabulary, or HF), and
  ``words``, the ids-as-words text form the built-in vocabulary and the workloads share.

The package sits at the shell's level of the rings (it reads files, logs and talks to
engines) but below ``shell``: it imports ``core``, ``wire``, ``config`` and ``http`` only.
``words`` is pure. The rough estimate that ``core`` uses (``core/tokens.py``) stays in
``core``, which must stay pure.
"""
