"""On-disk caches: log-mels (``features.py``), encoder states (``encoder.py``), and the data
files both write and share (``files.py``)."""
