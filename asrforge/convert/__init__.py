"""Conversions between asrforge's transformers Whisper directories and other formats:
CTranslate2 (faster-whisper) models imported into a transformers directory (``ct2.py``).

Exporting a bundle in CTranslate2 format stays in ``asrforge.bundle.export``: it writes a bundle
(inference config, manifest) and only calls CTranslate2's own converter.
"""
