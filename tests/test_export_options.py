"""``asrforge export`` refuses options its format or weights would ignore, and an --out that is a
symlink, before loading anything; a bundle names no code to load."""

from __future__ import annotations

import json

import pytest

from asrforge.bundle.export import export_bundle
from asrforge.cli import main

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--format", "ct2", "--quantization", "bogus"],
         "--quantization bogus: --format ct2 takes int8, int8_float32"),
        (["--quantization", "int8"], "--quantization: only with --format ct2 or ggml"),
        (["--format", "ggml", "--quantization", "int8"],
         "--quantization int8: --format ggml writes float16"),
        (["--k", "3"], "--k: only with --weights average"),
        (["--weights", "raw", "--k", "3", "--metric", "loss"],
         "--k and --metric: only with --weights average"),
    ],
)  # fmt: skip
def test_options_the_export_would_ignore_are_refused(tmp_path, capsys, argv, message):
    src = tmp_path / "model"
    src.mkdir()
    assert main(["export", str(src), "--out", str(tmp_path / "b"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_an_out_that_is_a_symlink_is_named_with_its_real_path(tmp_path, capsys):
    real = tmp_path / "tiny"
    real.mkdir()
    (tmp_path / "link").symlink_to("tiny")
    assert main(["export", str(tmp_path / "model"), "--out", str(tmp_path / "link")]) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path / 'link'}: a symlink (to tiny); give the real path ({real})" in err
    (tmp_path / "broken").symlink_to("nowhere")
    assert main(["export", str(tmp_path / "model"), "--out", str(tmp_path / "broken")]) == 2
    assert "a broken symlink (to nowhere)" in capsys.readouterr().err


def test_a_bundle_carries_no_auto_map_of_the_model_it_was_exported_from(tmp_path):
    from tests.test_data_hardening import save_random_whisper

    hf = tmp_path / "hf"
    save_random_whisper(hf)
    for name, key in (("config.json", "AutoConfig"), ("tokenizer_config.json", "AutoTokenizer")):
        data = json.loads((hf / name).read_text())
        data["auto_map"] = {key: "evil.Evil"}
        (hf / name).write_text(json.dumps(data))
    out = export_bundle(hf, tmp_path / "bundle")
    for name in ("config.json", "tokenizer_config.json"):
        assert "auto_map" not in json.loads((out / name).read_text()), name
    assert not list(out.glob("*.py"))


def test_an_export_onto_a_bundle_names_the_switch_of_whoever_asked(tmp_path, capsys):
    from asrforge.errors import UserError
    from tests.test_data_hardening import save_random_whisper

    save_random_whisper(tmp_path / "hf")
    bundle = export_bundle(tmp_path / "hf", tmp_path / "bundle")
    assert main(["export", str(tmp_path / "hf"), "--out", str(bundle)]) == 2
    err = capsys.readouterr().err
    assert f"--out {bundle}: already holds an hf bundle; --overwrite replaces all of it" in err
    assert "overwrite=True" not in err
    with pytest.raises(UserError) as refused:
        export_bundle(tmp_path / "hf", bundle)
    assert str(refused.value) == (
        f"out {bundle}: already holds an hf bundle; overwrite=True replaces all of it, or choose "
        "another directory"
    )


def test_an_lm_for_a_bundle_already_exported_says_how_a_bundle_gets_one(tmp_path, capsys):
    from asrforge.errors import UserError
    from tests.test_data_hardening import save_random_whisper

    save_random_whisper(tmp_path / "hf")
    bundle = export_bundle(tmp_path / "hf", tmp_path / "bundle")
    lm = tmp_path / "lm.arpa"
    lm.write_text("\\data\\\nngram 1=1\n\n\\1-grams:\n-1.0 a\n\n\\end\\\n")
    argv = ["export", str(bundle), "--out", str(tmp_path / "with-lm"), "--lm", str(lm)]
    assert main(argv) == 2
    said = (
        f"{bundle}: already an inference bundle, and a bundle's LM cannot be added or replaced "
        f"afterwards: export what it was exported from (a run, checkpoint or model) again with "
        f"--lm {lm}"
    )
    assert said in capsys.readouterr().err
    with pytest.raises(UserError, match="a bundle's LM cannot be added or replaced afterwards"):
        export_bundle(bundle, tmp_path / "with-lm", lm=lm)
    assert not (tmp_path / "with-lm").exists()
    # without an LM the refusal says what does take a bundle
    assert main(["export", str(bundle), "--out", str(tmp_path / "again")]) == 2
    assert "--format ct2` or `--format ggml` converts it" in capsys.readouterr().err
