"""Evaluation, shared by training, ``asrforge evaluate`` and the demo: teacher-forced loss and
decoding of utterance batches, ``evaluate_split`` of a bundle on one split (``evaluate.py``), and
long recordings transcribed as ``asrforge transcribe`` does (``longform.py``).

Imports no training code, so bundle/ can evaluate without the training loop.
"""
