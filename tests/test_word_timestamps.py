"""Word timestamps: dynamic time warping, the median filter, words from tokens, and the words a
bundle times (a tiny from-scratch model in the fast tier; Whisper tiny.en on espeak-ng speech)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from audio_fixtures import synthesize
from conftest import save_english_only_model
from test_bundle import one_thread  # noqa: F401  (autouse: one torch thread)
from test_ct2_import import ct2_tiny_en, hf_tiny_en  # noqa: F401  (session fixtures)

from asrforge.bundle.export import bundle_from_checkpoint
from asrforge.bundle.recognize import non_text_ids
from asrforge.bundle.subtitles import to_srt, word_cues
from asrforge.model.alignment import (
    MIN_WORD_DURATION,
    Word,
    add_word_timestamps,
    align_words,
    alignment_heads,
    cut_at_sentence_ends,
    dtw,
    median_filter,
    median_word,
    merge_punctuation,
    place_words,
    split_words,
    tidy_long_words,
    token_starts,
)
from asrforge.model.encoding import encode_waves
from asrforge.model.head_timing import speech_onset
from asrforge.model.longform import Segment

SR = 16_000
HOP = 320  # samples per encoder frame


@pytest.mark.fast
def test_dtw_follows_the_cheap_cells_of_each_row() -> None:
    # token i is cheap in frames [starts[i], starts[i + 1]): the path enters row i there
    starts = [0, 3, 4, 9, 14]
    cost = np.ones((4, 14))
    for i in range(4):
        cost[i, starts[i] : starts[i + 1]] = 0.0
    tokens, frames = dtw(cost)
    assert tokens[0] == 0 and frames[0] == 0 and tokens[-1] == 3 and frames[-1] == 13
    assert np.all(np.diff(tokens) >= 0) and np.all(np.diff(frames) >= 0)
    assert np.all(np.diff(tokens) + np.diff(frames) >= 1)  # a step moves
    entered = frames[np.diff(tokens, prepend=-1).astype(bool)]
    assert entered.tolist() == starts[:4]


@pytest.mark.fast
def test_dtw_path_cost_is_the_minimum_over_paths() -> None:
    rng = np.random.default_rng(0)
    cost = rng.random((3, 5))
    tokens, frames = dtw(cost)

    def best(i: int, j: int) -> float:  # brute force over monotonic paths
        if i == 0 and j == 0:
            return cost[0, 0]
        options = []
        if i > 0 and j > 0:
            options.append(best(i - 1, j - 1))
        if i > 0:
            options.append(best(i - 1, j))
        if j > 0:
            options.append(best(i, j - 1))
        return cost[i, j] + min(options)

    assert cost[tokens, frames].sum() == pytest.approx(best(2, 4))


@pytest.mark.fast
def test_a_lead_row_drawn_to_a_long_trailing_gap_leaves_the_text_its_own_frames() -> None:
    """The row before <|notimestamps|> attends to non-speech; a window that ends in a long gap
    rewarded it across the whole window, and every word started at the window's end (zero
    long). The text is then aligned without that row."""
    n_text, frames = 6, 150
    qk = torch.zeros(1, 2 + n_text + 1, frames)
    for k in range(n_text + 1):  # each row attends to the audio of the token after it
        qk[0, 1 + k, 8 + 8 * k : 16 + 8 * k] = 1.5
    qk[0, 0, 70:] = 3.0  # the lead row: the gap after the speech
    starts = token_starts(qk, 2, n_text, frames * HOP)
    assert starts[1:] == pytest.approx([0.32 + 0.16 * k for k in range(n_text)])
    # a lead row that takes only the silence before the words keeps it
    qk[0, 0] = 0.0
    qk[0, 0, :20] = 3.0
    qk[0, 1:, :20] = 0.0
    assert token_starts(qk, 2, n_text, frames * HOP)[0] > 0.2


@pytest.mark.fast
def test_median_filter_is_the_running_median_with_reflected_edges() -> None:
    x = torch.tensor([[5.0, 1.0, 9.0, 2.0, 8.0, 3.0, 7.0]])
    padded = np.pad(x[0].numpy(), 1, mode="reflect")
    expected = [np.median(padded[i : i + 3]) for i in range(7)]
    assert median_filter(x, 3)[0].tolist() == expected
    # Whisper's width on (heads, tokens, frames), ties included: numpy's median of each window
    heads = torch.randint(0, 5, (2, 3, 40)).float()
    padded = np.pad(heads.numpy(), [(0, 0), (0, 0), (3, 3)], mode="reflect")
    windows = np.lib.stride_tricks.sliding_window_view(padded, 7, axis=-1)
    assert torch.equal(median_filter(heads, 7), torch.from_numpy(np.median(windows, axis=-1)))


PIECES = {1: " We", 2: " li", 3: "brary", 4: ".", 5: " (", 6: "hi", 7: ")", 8: "\xe4"}


def _decode(ids: list[int]) -> str:
    # token 9 is the first byte of a two-byte character that token 8 completes
    text = "".join(PIECES.get(i, "") for i in ids if i != 9)
    return text if 9 not in ids or 8 in ids else text + "\ufffd"


@pytest.mark.fast
def test_words_start_at_a_space_and_keep_a_split_character_whole() -> None:
    assert split_words([1, 2, 3, 4], _decode, frozenset()) == [[1], [2, 3], [4]]
    assert split_words([1, 9, 8, 2], _decode, frozenset()) == [[1, 9, 8], [2]]
    assert split_words([1, 9, 8], _decode, frozenset(), unspaced=True) == [[1], [9, 8]]


@pytest.mark.fast
def test_punctuation_joins_its_word_which_keeps_its_own_time() -> None:
    words = [
        Word(" We", 0.0, 0.4, 0.9, (1,)),
        Word(" (", 0.4, 0.5, 0.5, (5,)),
        Word("hi", 0.5, 0.8, 0.7, (6,)),
        Word(")", 0.8, 0.9, 0.1, (7,)),
        Word(".", 0.9, 1.0, 0.3, (4,)),
    ]
    merged = merge_punctuation(words)
    assert [w.word for w in merged] == [" We", " (hi)."]
    assert (merged[1].start, merged[1].end, merged[1].tokens) == (0.5, 0.8, (5, 6, 7, 4))
    assert merged[1].probability == pytest.approx((0.5 + 0.7 + 0.1 + 0.3) / 4)


@pytest.mark.fast
def test_a_sentence_end_stretched_over_a_pause_is_cut_before_it_joins_its_word() -> None:
    """DTW gives the full stop the pause after it, and the word after the pause the pause
    before it: each is cut to twice the window's median word (openai-whisper's order: cut,
    then merge), so "noon." ends where "noon" does and "Then" starts near where it is said."""
    words = [
        Word(" We", 0.0, 0.3, 0.9),
        Word(" meet", 0.3, 0.6, 0.9),
        Word(" at", 0.6, 0.8, 0.9),
        Word(" noon", 0.8, 1.1, 0.9),
        Word(".", 1.1, 2.9, 0.9),
        Word(" Then", 2.9, 4.0, 0.9),
        Word(" go", 4.0, 4.3, 0.9),
    ]
    median = median_word(words)
    assert median == pytest.approx(0.3)
    cut_at_sentence_ends(words, 2 * median)
    assert words[4].end == pytest.approx(1.1 + 0.6) and words[5].start == pytest.approx(4.0 - 0.6)
    merged = merge_punctuation(words)
    assert [(w.word, w.start, w.end) for w in merged[3:5]] == [
        (" noon.", 0.8, 1.1),
        (" Then", pytest.approx(3.4), 4.0),
    ]
    # words of ordinary length are left alone
    same = [Word(" a", 0.0, 0.3, 0.9), Word(".", 0.3, 0.5, 0.9), Word(" b", 0.5, 0.9, 0.9)]
    cut_at_sentence_ends(same, 0.6)
    assert [(w.start, w.end) for w in same] == [(0.0, 0.3), (0.3, 0.5), (0.5, 0.9)]


@pytest.mark.fast
def test_audio_before_the_first_word_is_not_the_first_words() -> None:
    """Attention of prompt <|startoftranscript|> <|notimestamps|>, two text tokens and EOT over
    1 s (50 frames): the row before <|notimestamps|> on the first 0.4 s (silence), then each
    text token's row on its part. The first token starts at 0.4 s, not at the window's start."""
    qk = torch.zeros(1, 5, 50)
    for row, (a, b) in enumerate([(0, 20), (20, 30), (30, 40), (40, 50)]):
        qk[0, row, a:b] = 10.0
    starts = token_starts(qk, n_prompt=2, n_text=2, n_samples=SR)
    np.testing.assert_allclose(starts, [0.4, 0.6, 0.8], atol=0.021)


@pytest.mark.fast
def test_a_first_word_stretched_over_a_pause_starts_where_it_is_spoken() -> None:
    """The alignment's path starts at the window's first frame, so the first word of a
    recording that opens with 2.5 s of silence comes out starting at 0; it is cut to twice the
    median word, the silence going before it, as openai-whisper does."""
    words = [
        Word(" We", 0.0, 2.8, 0.9),
        Word(" meet", 2.8, 3.1, 0.9),
        Word(" at", 3.1, 3.3, 0.9),
        Word(" noon.", 3.3, 3.6, 0.9),
    ]
    end = tidy_long_words(words, 0.0, 3.6, last_speech=0.0, median=median_word(words))
    assert words[0].start == pytest.approx(2.8 - 2 * 0.3) and words[0].end == 2.8
    assert [w.start for w in words[1:]] == [2.8, 3.1, 3.3] and end == 3.6
    # right after speech (no pause) the same word is left alone
    words = [Word(" We", 0.0, 2.8, 0.9), Word(" meet", 2.8, 3.1, 0.9), Word(" at", 3.1, 3.3, 0.9)]
    tidy_long_words(words, 0.0, 3.3, last_speech=2.0, median=median_word(words))
    assert words[0].start == 0.0


def _tiny_windows(bundle) -> tuple[np.ndarray, list[Segment], list[list[int]]]:
    """3.5 s of noise and three segments over two windows: (wave, segments, their text ids)."""
    wave = np.random.default_rng(0).standard_normal(int(3.5 * SR)).astype(np.float32) * 0.1
    encode = bundle.tokenizer.encode
    ids = [encode(t, add_special_tokens=False) for t in (" la la", " tone beep", " boop la")]
    eot = bundle.specials.eot
    segments = [
        Segment(0.0, 1.0, "la la", [*ids[0], eot], (0.0, 2.0)),  # EOT is no text
        Segment(1.0, 2.0, "tone beep", ids[1], (0.0, 2.0)),
        Segment(2.0, 3.5, "boop la", ids[2], (2.0, 3.5)),
    ]
    return wave, segments, ids


def _time_words(bundle, wave: np.ndarray, segments: list[Segment], **options) -> None:
    add_word_timestamps(
        bundle.model,
        bundle.features,
        [wave],
        [segments],
        [bundle.specials.prompt("en")],
        ["en"],
        eot=bundle.specials.eot,
        decode=bundle.tokenizer.decode,
        non_text=non_text_ids(bundle),
        **options,
    )


@pytest.mark.fast
def test_a_tiny_model_times_every_token_of_its_windows_segments(tmp_path, tones_dir) -> None:
    """A from-scratch model (no recorded alignment heads: the upper half's): the segments of
    two windows get words that hold their text tokens in order, timed inside their window."""
    bundle = bundle_from_checkpoint(save_english_only_model(tmp_path, tones_dir))
    assert getattr(bundle.model.generation_config, "alignment_heads", None) is None
    assert alignment_heads(bundle.model) == [(1, 0), (1, 1)]
    wave, segments, ids = _tiny_windows(bundle)
    _time_words(bundle, wave, segments)
    for s, text_ids in zip(segments, ids, strict=True):
        assert [t for w in s.words for t in w.tokens] == text_ids
        assert "".join(w.word for w in s.words) == bundle.tokenizer.decode(text_ids)
        starts = [w.start for w in s.words]
        assert starts == sorted(starts)
        assert all(s.window[0] <= w.start <= w.end <= s.window[1] + 1e-6 for w in s.words)
        assert all(0.0 <= w.probability <= 1.0 for w in s.words)
    # the windows are aligned apart: the second starts its words at its own start
    assert segments[2].words[0].start == pytest.approx(2.0)


@pytest.mark.fast
def test_words_timed_without_probabilities_never_project_onto_the_vocabulary(
    tmp_path, tones_dir
) -> None:
    """The seek floor's alignment wants times only: the same words and times, no vocabulary
    projection, probabilities nan."""
    bundle = bundle_from_checkpoint(save_english_only_model(tmp_path, tones_dir))
    wave, _, ids = _tiny_windows(bundle)
    encoded = encode_waves(bundle.model, bundle.features, [wave[: 2 * SR]], "cpu", SR)
    timed = {}
    projections = []
    bundle.model.proj_out.register_forward_hook(lambda *_: projections.append(1))
    for probabilities in (True, False):
        timed[probabilities], _ = align_words(
            bundle.model, encoded, bundle.specials.prompt("en"), [*ids[0], *ids[1]], 2 * SR,
            eot=bundle.specials.eot, decode=bundle.tokenizer.decode,
            specials=frozenset(non_text_ids(bundle)), heads=alignment_heads(bundle.model),
            probabilities=probabilities,
        )  # fmt: skip
    assert len(projections) == 1
    with_p, without = timed[True], timed[False]
    assert [(w.word, w.start, w.end) for w in with_p] == [(w.word, w.start, w.end) for w in without]
    assert all(0.0 <= w.probability <= 1.0 for w in with_p)
    assert all(np.isnan(w.probability) for w in without)


@pytest.mark.fast
def test_the_heads_lag_is_taken_off_every_word_within_its_window(tmp_path, tones_dir) -> None:
    bundle = bundle_from_checkpoint(save_english_only_model(tmp_path, tones_dir))
    wave, plain, _ = _tiny_windows(bundle)
    _, early, _ = _tiny_windows(bundle)
    _time_words(bundle, wave, plain)
    _time_words(bundle, wave, early, lag=0.3)
    pairs = [(a, b, s.window[0]) for s, t in zip(plain, early, strict=True)
             for a, b in zip(s.words, t.words, strict=True)]  # fmt: skip
    assert len(pairs) >= 6
    for a, b, window_start in pairs:
        # each word the lag puts at its window's start is held a grid step long there, in order
        at_start = sum(c.end - 0.3 <= ws for c, _, ws in pairs if ws == window_start)
        held = at_start * MIN_WORD_DURATION
        # only the words the held ones reach move; the rest are the plain times less the lag
        step = (held if a.start - 0.3 <= window_start + held else 0.0) + 1e-9
        assert b.start == pytest.approx(max(window_start, a.start - 0.3), abs=step)
        assert b.end == pytest.approx(max(window_start, a.end - 0.3), abs=step)
        assert b.end > b.start
    assert any(a.start - 0.3 > window_start for a, _, window_start in pairs)
    assert any(a.start - 0.3 < window_start for a, _, window_start in pairs)


@pytest.mark.fast
def test_word_cues_are_one_subtitle_per_word() -> None:
    seg = Segment(1.0, 2.0, "We meet.", [1, 2])
    seg.words = [Word(" We", 1.0, 1.4, 0.9), Word(" meet.", 1.4, 2.0, 0.8)]
    srt = to_srt(word_cues([seg]))
    assert srt.splitlines()[:3] == ["1", "00:00:01,000 --> 00:00:01,400", "We"]
    assert "00:00:01,400 --> 00:00:02,000\nmeet." in srt


def test_tiny_en_times_a_sentence_after_a_pause(hf_tiny_en: Path) -> None:  # noqa: F811
    """Two sentences 2.5 s apart: the second sentence's first word starts after the pause,
    within 0.3 s of where its audio starts, and every word is where its sentence is."""
    first = synthesize("We will meet at the library tomorrow morning.")
    second = synthesize("The museum is closed on Mondays.")
    gap = np.zeros(int(2.5 * SR), np.float32)
    wave = np.concatenate([first, gap, second])
    onset = (first.shape[0] + gap.shape[0]) / SR
    bundle = bundle_from_checkpoint(hf_tiny_en)
    result = bundle.transcribe(wave, word_timestamps=True)
    words = result.words
    museum = next(i for i, w in enumerate(words) if "museum" in w.word.lower())
    the = words[museum - 1]
    assert the.word.strip().lower() == "the"
    assert abs(the.start - onset) < 0.3
    assert all(w.end <= onset + 0.1 for w in words[: museum - 1])
    assert words[0].start < 0.3 and words[-1].end <= wave.shape[0] / SR + 0.02
    assert " ".join(w.word.strip() for w in words) == " ".join(result.text.split())


def test_tiny_en_times_words_on_the_encodings_decoding_read(hf_tiny_en: Path, monkeypatch) -> None:  # noqa: F811
    from asrforge.model import longform

    first = synthesize("We will meet at the library tomorrow morning.")
    second = synthesize("The museum is closed on Mondays.")
    # two clips of one window and a recording of three windows (no VAD: windows by timestamps)
    waves = [first, second, np.concatenate([first, np.zeros(25 * SR, np.float32), second] * 2)]
    bundle = bundle_from_checkpoint(hf_tiny_en)
    rows = []
    hook = bundle.model.model.encoder.register_forward_hook(
        lambda _m, args, _out: rows.append(len(args[0]))
    )
    try:
        plain = bundle.recognize(waves, batch_size=2, vad=False)
        decoding = sum(rows)
        timed = bundle.recognize(waves, batch_size=2, vad=False, word_timestamps=True)
        reused = sum(rows) - decoding
        # each window encoded again to time its words, as before
        before = sum(rows)
        # at batch 1 the encodings held at once (four batches) are fewer than the windows
        one = bundle.recognize(waves, batch_size=1, vad=False, word_timestamps=True)
        held = sum(rows) - before
        monkeypatch.setattr(longform.EncodedWindows, "add", lambda *a: None)
        again = bundle.recognize(waves, batch_size=2, vad=False, word_timestamps=True)
        fresh = sum(rows) - before - held
    finally:
        hook.remove()
    assert [t.text for t in timed] == [t.text for t in plain] == [t.text for t in one]
    windows = {s.window for t in timed for s in t.segments}
    # without kept encodings each window is encoded again to time its words, and a window that
    # ends on timestamps once more for the seek's floor
    assert reused == decoding and fresh >= decoding + len(windows) > decoding + len(waves)
    assert decoding < held < decoding + len(windows)  # some encoded again, not all
    assert [w.word for t in one for w in t.words] == [w.word for t in timed for w in t.words]
    words = [w for t in timed for w in t.words]
    assert len(words) == sum(len(t.words) for t in again) > 10
    for w, v in zip(words, (w for t in again for w in t.words), strict=True):
        assert w.word == v.word
        assert (w.start, w.end) == pytest.approx((v.start, v.end), abs=0.021)


def test_tiny_en_starts_the_first_word_after_leading_silence(hf_tiny_en: Path) -> None:  # noqa: F811
    """A recording that opens with 0.6 s of silence (too short a pause for openai-whisper's
    rule for long first words): its first word starts within 0.2 s of its speech, not at 0."""
    lead = 0.6
    speech = synthesize("We will meet at the library tomorrow morning.")
    wave = np.concatenate([np.zeros(int(lead * SR), np.float32), speech])
    words = bundle_from_checkpoint(hf_tiny_en).transcribe(wave, word_timestamps=True).words
    assert words[0].word.strip() == "We"
    assert abs(words[0].start - (lead + speech_onset(speech))) < 0.2


def test_transcribe_word_timestamps_json_has_words(hf_tiny_en: Path, tmp_path: Path) -> None:  # noqa: F811
    import soundfile as sf

    from asrforge.cli import main

    clip = tmp_path / "clip.wav"
    sf.write(clip, synthesize("Please send me the report."), SR)
    out = tmp_path / "out"
    assert main(["transcribe", str(hf_tiny_en), str(clip), "--json", "--word-timestamps",
                 "--output-dir", str(out)]) == 0  # fmt: skip
    record = json.loads((out / "clip.json").read_text())
    words = [w for s in record["segments"] for w in s["words"]]
    assert [w["word"].strip() for w in words] == record["text"].split()
    assert all(set(w) == {"word", "start", "end", "probability"} for w in words)
    assert main(["transcribe", str(hf_tiny_en), str(clip), "--format", "vtt",
                 "--word-timestamps", "--output-dir", str(out)]) == 0  # fmt: skip
    assert (out / "clip.vtt").read_text().count(" --> ") == len(words)


@pytest.mark.fast
def test_a_zero_length_word_gets_a_cue_that_ends_by_the_next_word() -> None:
    seg = Segment(160.0, 162.0, "a single word", [1, 2])
    seg.words = [Word(" a", 160.5, 160.9, 0.9), Word(" single", 160.976, 160.976, 0.5),
                 Word(" word", 161.02, 161.02, 0.5), Word(" end", 161.5, 161.5, 0.5)]  # fmt: skip
    cues = word_cues([seg])
    assert [(c.start, c.end) for c in cues] == [
        (160.5, 160.9), (160.976, 161.02), (161.02, pytest.approx(161.12)),
        (161.5, pytest.approx(161.6)),
    ]  # fmt: skip
    assert all(c.end > c.start for c in cues)
    assert all(a.end <= b.start for a, b in zip(cues, cues[1:], strict=False))


@pytest.mark.fast
def test_words_sharing_a_cue_join_as_they_are_written() -> None:
    spaced = Segment(1.0, 2.0, "a b", [1, 2])
    spaced.words = [Word(" a", 1.0, 1.0, 0.9), Word(" b", 1.0, 1.2, 0.9)]
    unspaced = Segment(3.0, 4.0, "你好", [1, 2])
    unspaced.words = [Word("你", 3.0, 3.0, 0.9), Word("好", 3.0, 3.2, 0.9)]
    assert [c.text for c in word_cues([spaced, unspaced])] == ["a b", "你好"]


def _timed(*times: tuple[float, float]) -> list[Word]:
    return [Word(f" w{k}", a, b, 0.9, (k,)) for k, (a, b) in enumerate(times)]


def _apart_and_timed(segments: list[list[Word]], earliest: float, latest: float) -> list[Word]:
    """Every word of ``segments``, after checking they are in order, apart and in bounds."""
    words = [w for ws in segments for w in ws]
    assert all(earliest <= w.start < w.end <= latest for w in words)
    assert all(a.end <= b.start + 1e-9 for a, b in zip(words, words[1:], strict=False))
    return words


@pytest.mark.fast
def test_words_that_start_on_one_frame_are_given_a_frame_from_the_time_after() -> None:
    # two words on the frame where a third starts, then a segment's last word at its end
    words = _timed((1.0, 1.0), (1.0, 1.0), (1.0, 1.4), (1.4, 2.0), (2.0, 2.0))
    placed, end = place_words(words, 0.4, [(1.0, 2.0, 5)], audio_end=3.0)
    got = [t for w in _apart_and_timed(placed, 1.0, 2.0) for t in (w.start, w.end)]
    step = MIN_WORD_DURATION
    assert got == pytest.approx([
        1.0, 1.0 + step, 1.0 + step, 1.0 + 2 * step, 1.0 + 2 * step, 1.4,
        1.4, 2.0 - step, 2.0 - step, 2.0,
    ])  # fmt: skip
    assert end == pytest.approx(2.0)


@pytest.mark.fast
def test_the_speech_end_long_form_seeks_from_is_the_aligned_one_without_held_frames() -> None:
    # a last word of no length at 2.3: held, it would end a frame later
    words = _timed((1.0, 1.4), (1.4, 2.3), (2.3, 2.3))
    held, held_end = place_words(words, 0.4, [(1.0, 2.5, 3)], audio_end=3.0)
    aligned, aligned_end = place_words(words, 0.4, [(1.0, 2.5, 3)], audio_end=3.0, hold=False)
    assert [(w.start, w.end) for w in aligned[0]][-1] == pytest.approx((2.3, 2.3))
    assert held_end == pytest.approx(aligned_end + MIN_WORD_DURATION)


@pytest.mark.fast
def test_a_words_length_stays_within_its_segment_and_the_audio() -> None:
    # the first segment's last word, at its end timestamp, borrows from the word before it,
    # not from the next segment; the recording's last word stops where the audio does
    words = _timed((27.0, 27.48), (27.48, 27.48), (27.48, 27.9), (27.9, 28.0), (28.0, 28.0))
    spans = [(26.8, 27.48, 2), (27.48, 28.4, 3)]
    placed, _ = place_words(words, 0.4, spans, audio_end=28.0)
    got = _apart_and_timed(placed, 26.8, 28.0)
    assert [len(ws) for ws in placed] == [2, 3]
    assert (got[1].start, got[1].end) == pytest.approx((27.48 - MIN_WORD_DURATION, 27.48))
    assert got[2].start == pytest.approx(27.48)
    assert (got[4].start, got[4].end) == pytest.approx((28.0 - MIN_WORD_DURATION, 28.0))


@pytest.mark.fast
def test_words_of_a_window_offset_and_late_are_held_after_the_speech_before() -> None:
    words = _timed((0.0, 0.0), (0.0, 0.3))
    placed, _ = place_words(words, 0.3, [(10.0, 10.3, 2)], offset=10.0, lag=0.1,
                            last_speech=10.0, audio_end=10.3)  # fmt: skip
    got = _apart_and_timed(placed, 10.0, 10.3)
    assert (got[0].start, got[0].end) == pytest.approx((10.0, 10.0 + MIN_WORD_DURATION))


@pytest.mark.fast
def test_a_word_with_no_time_before_the_next_shares_its_cue() -> None:
    seg = Segment(8.0, 9.0, "thank you all", [1, 2])
    seg.words = [Word(" thank", 8.2, 8.64, 0.9), Word(" you", 8.64, 8.64, 0.5),
                 Word(" all", 8.64, 8.9, 0.9)]  # fmt: skip
    cues = word_cues([seg])
    got = [(c.start, c.end, c.text) for c in cues]
    assert got == [(8.2, 8.64, "thank"), (8.64, 8.9, "you all")]
    assert "00:00:08,640 --> 00:00:08,900\nyou all" in to_srt(cues)


@pytest.mark.fast
def test_attention_scores_are_the_callers_while_another_thread_decodes() -> None:
    """The capture hooks sit on the shared model: another thread's pass must not fill them."""
    import threading

    from test_beam import _model

    from asrforge.model.alignment import cross_attention

    model = _model()
    heads = [(0, 1), (1, 0)]
    g = torch.Generator().manual_seed(0)
    mine, theirs = torch.randn(1, 20, 32, generator=g), torch.randn(3, 20, 32, generator=g)
    ids = torch.tensor([[1, 3, 4, 5, 6]])
    with torch.no_grad():
        _, alone = cross_attention(model, mine, ids, heads, logits=False)
    stop = threading.Event()

    def decode_elsewhere() -> None:
        other = torch.tensor([[1, 7, 8]] * 3)
        with torch.no_grad():
            while not stop.is_set():
                model.model.decoder(input_ids=other, encoder_hidden_states=theirs, use_cache=False)

    worker = threading.Thread(target=decode_elsewhere)
    worker.start()
    try:
        with torch.no_grad():
            results = [cross_attention(model, mine, ids, heads, logits=False)[1] for _ in range(40)]
    finally:
        stop.set()
        worker.join()
    assert all(torch.equal(r, alone) for r in results)


def _dtw_cell_by_cell(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The accumulated cost one cell at a time, ties to the diagonal, then down."""
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    acc[0, 0] = 0.0
    trace = np.zeros((n + 1, m + 1), dtype=int)
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            options = (acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1])
            down_or_right = 1 if options[1] <= options[2] else 2
            trace[i, j] = 0 if options[0] <= min(options[1:]) else down_or_right
            acc[i, j] = cost[i - 1, j - 1] + options[trace[i, j]]
    path, (i, j) = [], (n, m)
    while i > 0 and j > 0:
        path.append((i - 1, j - 1))
        i, j = {0: (i - 1, j - 1), 1: (i - 1, j), 2: (i, j - 1)}[trace[i, j]]
    tokens, frames = zip(*path[::-1], strict=True)
    return np.array(tokens), np.array(frames)


@pytest.mark.fast
@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (6, 1), (5, 9), (12, 40), (40, 12)])
def test_dtw_takes_the_path_the_cell_by_cell_recurrence_takes_ties_included(shape) -> None:
    rng = np.random.default_rng(sum(shape))
    for cost in (rng.random(shape), rng.integers(0, 3, shape).astype(np.float32)):  # ties
        expected = _dtw_cell_by_cell(cost)
        got = dtw(cost)
        assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
