"""End-to-end recipes built on the library, each behind an ``asrforge`` command: the demo
(``demo.py``, ``asrforge demo``) and the espeak-ng speech corpus it trains on (``corpus.py`` with
its sentence sources ``sentences.py``, ``asrforge corpus``).

A recipe may import any layer; no layer imports a recipe.
"""
