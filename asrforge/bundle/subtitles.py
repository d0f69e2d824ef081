"""Subtitle files from timed segments: SubRip (``.srt``) and WebVTT (``.vtt``)."""

from __future__ import annotations

from collections.abc import Sequence

from asrforge.model.longform import Segment


def timestamp(seconds: float, separator: str) -> str:
    """``HH:MM:SS,mmm`` (``separator`` ``,``: SubRip) or ``HH:MM:SS.mmm`` (``.``: WebVTT)."""
    ms = max(0, round(seconds * 1000))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{ms:03d}"


def _cue_text(text: str, *, vtt: bool = False) -> str:
    """``text`` on one line, fit for a SubRip cue or (``vtt``) a WebVTT one."""
    text = " ".join(text.split())  # a blank line would end the cue
    if vtt:
        # WebVTT reads "&" and "<" as an escape's or a tag's start; with ">" escaped as well no
        # "-->" is left to start a timing line, and a player shows it as it was said
        return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    # SubRip has no escapes: "-->" would start a timing line
    return text.replace("-->", "->")


def to_srt(segments: Sequence[Segment]) -> str:
    """Numbered SubRip cues, one per segment."""
    cues = [
        f"{i}\n{timestamp(s.start, ',')} --> {timestamp(s.end, ',')}\n{_cue_text(s.text)}\n"
        for i, s in enumerate(segments, start=1)
    ]
    return "\n".join(cues)


def to_vtt(segments: Sequence[Segment]) -> str:
    """A WebVTT file, one cue per segment."""
    cues = [
        f"{timestamp(s.start, '.')} --> {timestamp(s.end, '.')}\n{_cue_text(s.text, vtt=True)}\n"
        for s in segments
    ]
    return "\n".join(["WEBVTT\n", *cues])


MIN_WORD_CUE = 0.1
"""Seconds a word cue lasts at least, where the next cue leaves room."""


def word_cues(segments: Sequence[Segment]) -> list[Segment]:
    """One cue per timed word of ``segments`` (their ``words``), for word-level subtitles; a
    word timed shorter than :data:`MIN_WORD_CUE` (down to zero length) is held longer, up to
    the next word's start, and one the next word leaves no time (in milliseconds, as cues are
    written) shares that word's cue."""
    words = [w for s in segments for w in s.words or []]
    cues = []
    held = []  # words with no time of their own, shown with the next word
    for k, w in enumerate(words):
        end = w.end
        if end - w.start < MIN_WORD_CUE:
            # Players drop or flash a zero-length cue; a tenth of a second is the shortest a
            # reader notices, and ending by the next word's start keeps cues apart.
            following = words[k + 1].start if k + 1 < len(words) else float("inf")
            end = max(end, min(w.start + MIN_WORD_CUE, following))
        held.append(w)
        if round(end * 1000) <= round(w.start * 1000):
            continue
        # words keep their leading space, so words written without spaces join without one
        text = "".join(h.word for h in held).strip()
        cues.append(Segment(held[0].start, end, text))
        held = []
    return cues
