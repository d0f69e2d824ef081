"""File input/output every layer shares: atomic writes and fsync (``atomic.py``), files opened
in place without following a symlink (``append.py``), ``flock`` locks (``locks.py``), small
files read whole within bounds (``small_files.py``).

Generic, light (no torch) and free of our other packages but ``errors``, so data/, model/,
checkpoint/, matrix/ and bundle/ can all use it without depending on one another.
"""
