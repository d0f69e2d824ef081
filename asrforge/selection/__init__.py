"""Checkpoint selection: after each evaluation, is this the new best checkpoint, and should the
run stop? The policies and patience (``policies.py``), the forgetting guard's gate
(``guard_gate.py``), the language-group table (``groups.py``) and the selector that holds them
in the training checkpoint (``selector.py``).

How it works: docs/guard.md, "How the selector decides".
"""
