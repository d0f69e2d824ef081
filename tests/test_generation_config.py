"""One source of the generation config's token fields (SpecialTokens.generation_fields) for the
three places that write one: the model built for training, the exported bundle and the
CTranslate2 import. They must agree, so transformers' generate prompts and stops alike in each."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import GenerationConfig, WhisperConfig

from asrforge.bundle.contents import generation_config as bundle_generation_config
from asrforge.convert.ct2 import _generation_config as ct2_generation_config
from asrforge.model.build import _set_generation_defaults
from asrforge.model.tokenizer import SpecialTokens

pytestmark = pytest.mark.fast

# openai's multilingual id layout, shortened to two languages
NAMES = [
    "<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|zh|>", "<|translate|>",
    "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>",
]  # fmt: skip
IDS = {name: 50257 + i for i, name in enumerate(NAMES)}
TOKEN_FIELDS = (
    "decoder_start_token_id", "eos_token_id", "pad_token_id", "no_timestamps_token_id",
    "is_multilingual", "lang_to_id", "task_to_id",
)  # fmt: skip


def _specials(multilingual: bool) -> SpecialTokens:
    return SpecialTokens(
        sot=IDS["<|startoftranscript|>"],
        eot=IDS["<|endoftext|>"],
        no_timestamps=IDS["<|notimestamps|>"],
        tasks={"translate": IDS["<|translate|>"], "transcribe": IDS["<|transcribe|>"]}
        if multilingual
        else {},
        languages={"en": IDS["<|en|>"], "zh": IDS["<|zh|>"]} if multilingual else {},
        multilingual=multilingual,
    )


def _fields(gc: GenerationConfig) -> dict:
    return {name: getattr(gc, name, None) for name in TOKEN_FIELDS}


@pytest.mark.parametrize("multilingual", [True, False])
def test_built_exported_and_imported_generation_configs_agree(multilingual):
    specials = _specials(multilingual)
    built = SimpleNamespace(generation_config=GenerationConfig())
    _set_generation_defaults(built, specials)
    icfg = SimpleNamespace(languages=["en", "zh"], data=SimpleNamespace(task="transcribe"))
    config = WhisperConfig(vocab_size=51865 if multilingual else 51864)
    exported = bundle_generation_config(None, config, specials, icfg)
    ct2 = {"lang_ids": [IDS["<|en|>"], IDS["<|zh|>"]]}
    imported = ct2_generation_config(config, ct2, IDS)

    assert _fields(built.generation_config) == _fields(exported) == _fields(imported)
    assert exported.bos_token_id == imported.bos_token_id == IDS["<|endoftext|>"]
    if multilingual:
        assert exported.lang_to_id == {"<|en|>": 50259, "<|zh|>": 50260}
        assert exported.task_to_id == {"translate": 50261, "transcribe": 50262}
    else:
        assert getattr(exported, "lang_to_id", None) is None
        assert getattr(exported, "task_to_id", None) is None


def test_an_exported_bundle_offers_only_its_own_languages():
    specials = _specials(True)
    icfg = SimpleNamespace(languages=["zh", "xx"], data=SimpleNamespace(task="translate"))
    base = GenerationConfig(lang_to_id={"<|en|>": 50259}, task="transcribe", language="en")
    gen = bundle_generation_config(base, WhisperConfig(vocab_size=51865), specials, icfg)
    assert gen.lang_to_id == {"<|zh|>": 50260}  # not the base model's, nor a code without token
    assert (gen.task, getattr(gen, "language", None)) == ("translate", None)
