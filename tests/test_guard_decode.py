"""``eval.guard.decode: transcribe``: the guard judges a model as ``asrforge transcribe`` runs it
(language detected, timestamps), where ``prompt`` gives each item its own language."""

from __future__ import annotations

import numpy as np
import pytest
from audio_fixtures import synthesize
from conftest import save_english_only_model
from test_bundle import one_thread  # noqa: F401  (autouse: one torch thread)
from test_ct2_import import ct2_tiny_en, hf_tiny_en  # noqa: F401  (session fixtures)

from asrforge.bundle.export import bundle_from_checkpoint
from asrforge.config import GuardConfig
from asrforge.evaluation.guard import bundle_transcripts
from asrforge.evaluation.guard_items import GuardItem


@pytest.mark.fast
def test_the_guard_decodes_each_item_as_transcribe_does(tmp_path, tones_dir, monkeypatch):
    bundle = bundle_from_checkpoint(save_english_only_model(tmp_path, tones_dir))
    rng = np.random.default_rng(0)
    items = [
        GuardItem(f"g{k}", (rng.standard_normal(int(s * 16000)) * 0.1).astype(np.float32),
                  None, "en")
        for k, s in enumerate((0.6, 1.3, 1.9))
    ]  # fmt: skip
    as_users = [bundle.transcribe(i.wave, max_new_tokens=12).strip() for i in items]
    assert bundle_transcripts(bundle, items, 2, 12, decode="transcribe") == as_users
    # the guard took transcribe's way, not only its result (this model decodes alike either way)
    from asrforge.evaluation import guard as guard_module

    calls = []
    real = guard_module.transcribe_long
    monkeypatch.setattr(guard_module, "transcribe_long",
                        lambda *a, **k: calls.append(len(a[3])) or real(*a, **k))  # fmt: skip
    bundle_transcripts(bundle, items, 2, 12)
    assert calls == []
    bundle_transcripts(bundle, items, 2, 12, decode="transcribe")
    assert calls == [2, 1]
    assert GuardConfig(path=tmp_path).decode == "prompt"
    with pytest.raises(ValueError, match="decode"):
        GuardConfig(path=tmp_path, decode="bundle")


def test_tiny_en_guard_windows_decode_with_timestamps_as_transcribe_does(hf_tiny_en):  # noqa: F811
    from asrforge.model.longform import choose_chunking

    bundle = bundle_from_checkpoint(hf_tiny_en)
    assert choose_chunking(bundle.tokenizer, bundle.model.config, None)[0] == "timestamps"
    texts = ["We will meet at the library tomorrow morning.", "It is a beautiful day."]
    gap = np.zeros(8000, np.float32)
    items = [GuardItem("g0", np.concatenate([synthesize(texts[0]), gap, synthesize(texts[1])]),
                       " ".join(texts), "en"),
             GuardItem("g1", synthesize(texts[1], "en-gb"), texts[1], "en")]  # fmt: skip
    as_users = [bundle.transcribe(i.wave, max_new_tokens=64).strip() for i in items]
    assert bundle_transcripts(bundle, items, 2, 64, decode="transcribe") == as_users
    assert all("library" in t.lower() or "beautiful" in t.lower() for t in as_users)


@pytest.mark.fast
def test_a_start_decoded_another_way_is_refused_and_the_way_rides_in_the_state():
    from asrforge.errors import UserError
    from asrforge.evaluation.guard import Guard
    from asrforge.selection.guard_gate import GuardGate

    items = [GuardItem("g0", np.zeros(16, np.float32), "la la", "en")]

    def guard(decode: str) -> Guard:
        return Guard(items, mode="drift", features=None, tokenizer=None, prompt=lambda lang: [0],
                     eot=0, batch_size=1, max_new_tokens=4, decode=decode, no_timestamps=1)  # fmt: skip

    gate = GuardGate(0.02)
    gate.set_start(0.0, "drift", {"g0": "la la"}, decode="transcribe")
    resumed = GuardGate(0.02)
    resumed.load_state_dict(gate.state_dict())
    assert resumed.decode == "transcribe"
    with pytest.raises(UserError, match="decoded as transcribe, this config decodes as prompt"):
        guard("prompt").measure(None, resumed, device="cpu")
    # a start recorded before the choice existed was decoded as prompt
    older = GuardGate(0.02)
    older.set_start(0.0, "drift", {"g0": "la la"})
    with pytest.raises(UserError, match="decoded as prompt, this config decodes as transcribe"):
        guard("transcribe").measure(None, older, device="cpu")


@pytest.mark.fast
def test_a_multilingual_guard_decodes_in_the_language_it_detects(tmp_path, tones_dir):
    """Items labelled English, a model that hears French in everything: the guard decodes
    each in French, as transcribe does."""
    from test_bundle_languages import multilingual_base

    bundle = bundle_from_checkpoint(multilingual_base(tmp_path, tones_dir, detects="fr"))
    rng = np.random.default_rng(1)
    items = [GuardItem(f"g{k}", (rng.standard_normal(16000) * 0.1).astype(np.float32), None, "en")
             for k in range(2)]  # fmt: skip
    assert [bundle.detect_language(i.wave) for i in items] == ["fr", "fr"]
    as_users = [bundle.transcribe(i.wave, max_new_tokens=8).strip() for i in items]
    assert bundle_transcripts(bundle, items, 2, 8, decode="transcribe") == as_users
