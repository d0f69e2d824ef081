"""Everything ``Trainer.fit`` needs before its first step: the run directory and its log, the
accelerator, data, tokenizer, model, selection policy, checkpoint manager and resume state."""

from __future__ import annotations

import logging
import platform
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asrforge.checkpoint import (
    CheckpointManager,
    TrainingCheckpoint,
    load_training_checkpoint,
)
from asrforge.checkpoint.manager import averaging_specs
from asrforge.checkpoint.resume import (
    check_resume_commits,
    check_resume_config,
    check_resume_epochs,
    check_resume_steps,
    continue_epoch,
    find_resume_checkpoint,
    keep_global_batch,
)
from asrforge.checkpoint.training import TOKENIZER_DIR, save_tokenizer
from asrforge.config import TrainConfig
from asrforge.data.dataset import (
    Collator,
    SpeechDataset,
    language_counts,
)
from asrforge.data.prepare import language_value_counts
from asrforge.data.replay import ReplayUtterances
from asrforge.data.rules import (
    SkipReport,
    check_english_only,
    language_filter,
    unheard_languages,
)
from asrforge.data.sampling import LanguageSampling
from asrforge.data.stream import StreamedSplit
from asrforge.data.workers import usable_cores
from asrforge.errors import UserError
from asrforge.io.atomic import atomic_directory
from asrforge.model import lora
from asrforge.model.build import (
    BuiltModel,
    build_model,
    build_tokenizer,
    count_parameters,
    is_multilingual,
)
from asrforge.model.lowbit import prepare_for_training, quantization_config
from asrforge.model.tokenizer import load_tokenizer
from asrforge.run_layout import RunLayout
from asrforge.selection.groups import mixed_groups, run_language
from asrforge.selection.selector import Selector, build_selector
from asrforge.train.eval_plan import plan_warnings
from asrforge.train.loaders import RunLoaders
from asrforge.train.paths import local_path_problems
from asrforge.train.precision import enable_cpu_fp16
from asrforge.train.ranks import main_process_first
from asrforge.train.records import hub_commits, write_config
from asrforge.train.run_log import StartupClock, setup_logging
from asrforge.train.setup_data import (
    build_text_batches,
    data_phase,
    setup_data,
    setup_splits,
)

log = logging.getLogger("asrforge.train")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class RunSetup:
    """The built pieces of a run (see :func:`prepare_run`)."""

    cfg: TrainConfig
    output_dir: Path
    accelerator: Any
    model_bundle: BuiltModel
    train_set: SpeechDataset | StreamedSplit
    """The training split's utterances, or with ``data.stream.enabled`` its stream."""
    eval_set: SpeechDataset
    loaders: RunLoaders
    """Serves ``train_set`` and ``eval_set`` (and the text-only batches) during the run."""
    selector: Any
    checkpoints: CheckpointManager
    max_steps: int
    n_params: tuple[int, int]
    resume_from: TrainingCheckpoint | None
    log_handler: logging.Handler | None
    startup: StartupClock = field(default_factory=StartupClock)
    """Seconds per start-up phase (imports, config, data set, tokenizer, model, splits, first
    step)."""
    lora_base: str | None = None
    """With ``model.lora``: sha256 of the base weights under the adapters (see
    ``asrforge.model.lora``), recorded in every checkpoint's manifest."""
    hub_commits: dict = field(default_factory=dict)
    """The Hub commit of each model and data set read by id (``records.hub_commits``), recorded
    in ``hub_commits.json`` and every checkpoint's manifest."""

    @property
    def train_languages(self) -> Counter:
        """Utterances per language of the training split (of a stream's first shard)."""
        return _train_languages(self.train_set)

    train_skipped: SkipReport | None = None
    """What preparing the training split skipped up front (nothing for a stream: its rows are
    checked as they stream by); the clips the workers drop during training are added to it in
    ``skipped-<split>.json`` (:func:`asrforge.train.records.write_skip_report`)."""

    train_data: dict = field(default_factory=dict)
    """The training split's usable utterances, identified (``SpeechDataset.fingerprint``) for
    every checkpoint's ``TrainState.train_data``; empty for a stream."""

    @property
    def model(self):
        return self.model_bundle.model

    def close(self) -> None:
        self.loaders.close()
        if self.log_handler is not None:
            logging.getLogger("asrforge").removeHandler(self.log_handler)
            self.log_handler.close()


def prepare_run(
    cfg: TrainConfig,
    *,
    precision: str,
    resume: bool,
    start_over: bool = False,
    startup: dict[str, float] | None = None,
) -> RunSetup:
    """Build the run, one phase after another. Raises UserError for anything the user must fix.

    ``resume``/``start_over``: see :func:`asrforge.checkpoint.resume.find_resume_checkpoint`.
    ``startup``: seconds of the phases timed before (the CLI's), first in the run's record.
    """
    # The train command checked these already; a run started from Python has not.
    if problems := local_path_problems(cfg):
        raise UserError("; ".join(problems))
    out = Path(cfg.output_dir)
    acc = start_accelerator(cfg, precision)
    handler = open_run_dir(out, acc)
    # A refused resume changes nothing: its config is checked before anything else is written.
    manager, resume_from, commits = find_resume(
        cfg, out, acc, resume=resume, start_over=start_over
    )
    # Seeded before anything draws: the model's initial weights and new tokens' embeddings.
    seed_everything(cfg.seed)
    clock = StartupClock(startup)
    log_run_start(out, acc)
    # The splits come first: a tokenizer trained from scratch learns from their texts.
    train_source, eval_split, train_texts = setup_splits(cfg, out, acc, resume_from)
    clock.lap("data set")
    # An English-only model is refused other languages from its files, before its weights load.
    check_model_languages(cfg, train_source, eval_split)
    # The model's vocabulary is the tokenizer's.
    tokenizer = run_tokenizer(cfg, out, acc, train_texts)
    clock.lap("tokenizer")
    bundle, lora_base = build_run_model(cfg, tokenizer, resume_from, precision, acc.device)
    clock.lap("model")
    n_params = log_model(bundle.model)
    # The data sets check labels with the tokenizer and clips against the model's window.
    # A resume on other training utterances is refused before their skip report is written.
    train_set, eval_set, train_skipped, packing = setup_data(
        cfg, out, acc, bundle, train_source, eval_split, precision, resume_from=resume_from
    )
    clock.lap(data_phase(cfg, packing))
    # The selection policy is chosen by the languages the training set holds.
    langs = _train_languages(train_set)
    if acc.is_main_process and (unheard := unheard_languages(cfg.data.languages, langs)):
        log.warning("data.languages: %s: no usable clip of the training split is in %s; the run "
                    "trains on %s", ", ".join(unheard), "it" if len(unheard) == 1 else "them",
                    ", ".join(f"{k} ({n})" for k, n in sorted(langs.items(), key=str)))  # fmt: skip
    selector, max_steps = build_run_selector(cfg, langs, n_params)
    if resume_from is not None and max_steps < cfg.train.max_steps:
        check_resume_steps(
            resume_from, max_steps, "the selection's step cap (selection.max_steps or its group's)"
        )
    text = build_text_batches(cfg, bundle, langs) if cfg.data.asr_ratio < 1.0 else None
    if acc.is_main_process:
        write_config(out, cfg, commits)
    sampling = None
    # a stream draws its own (StreamedSplit.prepare), shard by shard
    if cfg.data.sampling is not None and not isinstance(train_set, StreamedSplit):
        sampling = LanguageSampling.of(train_set.utts, cfg.data.sampling, cfg.seed)
        if packing is not None:
            packing.sampling = sampling
    loaders = RunLoaders(
        cfg=cfg,
        accelerator=acc,
        train_set=train_set,
        eval_set=eval_set,
        collator=Collator(pad_id=bundle.specials.eot),
        text=text,
        packing=packing,
        sampling=sampling,
    )
    log.info(
        "data: %d DataLoader worker(s) per process (data.num_workers: %s)%s",
        loaders.loader_workers,
        cfg.data.num_workers,
        ", pinned memory" if loaders.pin_memory else "",
    )
    if cfg.data.num_workers != "auto" and loaders.loader_workers < cfg.data.num_workers:
        log.warning(
            "data.num_workers: %d is more than the %d cores this process may use: %d workers",
            cfg.data.num_workers, usable_cores(), loaders.loader_workers,
        )  # fmt: skip
    return RunSetup(
        cfg=cfg,
        output_dir=out,
        accelerator=acc,
        model_bundle=bundle,
        train_set=train_set,
        eval_set=eval_set,
        loaders=loaders,
        selector=selector,
        checkpoints=manager,
        max_steps=max_steps,
        n_params=n_params,
        resume_from=resume_from,
        log_handler=handler,
        startup=clock,
        lora_base=lora_base,
        hub_commits=commits,
        train_skipped=train_skipped,
        # a stream's shards are checked and recorded on their own (stream_position)
        train_data={} if isinstance(train_set, StreamedSplit) else train_set.fingerprint,
    )


def log_run_start(out: Path, acc) -> None:
    log.info(
        "asrforge run in %s (python %s, torch %s, device %s, %d process(es))",
        out,
        platform.python_version(),
        torch.__version__,
        acc.device,
        acc.num_processes,
    )


def check_model_languages(cfg: TrainConfig, train_source, eval_split) -> None:
    """Refuse, before the model loads, a language other than English in the splits that train
    or select a run under an English-only ``model.pretrained`` (read from its config files; a
    stream's first shard, its later rows as they stream by).

    Raises:
        UserError: naming the languages and the ways out (:func:`check_english_only`).
    """
    if is_multilingual(cfg.model):
        return
    keep = language_filter(cfg.data.languages)
    if isinstance(train_source, StreamedSplit):
        check_english_only(train_source.languages, cfg.data.train_split, False, keep)
    else:
        check_english_only(language_value_counts(train_source), cfg.data.train_split, False, keep)
    if eval_split is not None:
        check_english_only(language_value_counts(eval_split), cfg.data.eval_split, False, keep)


def log_model(model) -> tuple[int, int]:
    """The model's (all, trainable) parameters, logged with its shape."""
    n_params = count_parameters(model)
    log.info(
        "model: %s parameters (%s trainable), d_model %d, %d+%d layers, vocab %d",
        f"{n_params[0]:,}",
        f"{n_params[1]:,}",
        model.config.d_model,
        model.config.encoder_layers,
        model.config.decoder_layers,
        model.config.vocab_size,
    )
    return n_params


def _train_languages(train_set: SpeechDataset | StreamedSplit) -> Counter:
    if isinstance(train_set, StreamedSplit):
        # every shard's language column (read once a run): the first shard may hold one language
        return train_set.as_trained(train_set.language_counts())
    utts = train_set.utts
    # replay rows (data.replay) are what the run must keep, not the language it learns
    return language_counts(utts.train if isinstance(utts, ReplayUtterances) else utts)


def start_accelerator(cfg: TrainConfig, precision: str):
    """The run's ``Accelerator``: DDP across processes, ``precision`` autocast, and on a CPU the
    fp16 loss scaler too (:func:`enable_cpu_fp16`)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedDataParallelKwargs

    if AcceleratorState._shared_state and AcceleratorState().mixed_precision != precision:
        # One process, several runs (a notebook, a test session): accelerate keeps one
        # precision per process; start this run's state afresh, keeping the process group.
        AcceleratorState._reset_state(reset_partial_state=False)
    # cpu=True also when "auto" finds no GPU: without it, accelerate under torchrun on a CPU-only
    # machine makes every process a separate one-process run (all writing the same run dir)
    on_cpu = cfg.train.device == "cpu" or not torch.cuda.is_available()
    # a text-only batch leaves the encoder unused: DDP must not wait for its gradients
    ddp = DistributedDataParallelKwargs(find_unused_parameters=cfg.data.asr_ratio < 1.0)
    acc = Accelerator(
        mixed_precision=precision,
        cpu=on_cpu,
        gradient_accumulation_steps=1,  # the loop accumulates itself, visibly
        kwargs_handlers=[ddp],
    )
    enable_cpu_fp16(acc)
    return acc


def open_run_dir(out: Path, acc) -> logging.Handler | None:
    """Create the run directory (rank zero, the others wait) and log to its ``train.log``."""
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
    acc.wait_for_everyone()
    return setup_logging(out, acc.is_main_process)


def find_resume(
    cfg: TrainConfig, out: Path, acc, *, resume: bool, start_over: bool
) -> tuple[CheckpointManager, TrainingCheckpoint | None, dict]:
    """The run's checkpoint manager (interrupted saves recovered), the checkpoint to resume
    from, and the Hub commits the run reads (:func:`hub_commits`); the config and the commits
    are checked against the checkpoint's before anything is written (a refused resume changes
    nothing)."""
    manager = CheckpointManager(
        RunLayout(out).checkpoints.root,
        save_total_limit=cfg.checkpoint.save_total_limit,
        keep_best=list(cfg.checkpoint.keep_best),
        protect_top=averaging_specs(cfg.callbacks),
        max_disk_gb=cfg.checkpoint.max_disk_gb,
        keep_start=cfg.keeps_step_zero,
        log=log,
    )
    if acc.is_main_process:
        manager.recover()
    latest = find_resume_checkpoint(
        manager, resume=resume, start_over=start_over, is_main=acc.is_main_process, log=log
    )
    resume_from = load_training_checkpoint(latest) if latest is not None else None
    commits = hub_commits(cfg)
    if resume_from is not None:
        check_resume_config(cfg, resume_from.config_yaml, resume_from.path, log)
        check_resume_steps(resume_from, cfg.train.max_steps, "train.max_steps")
        check_resume_epochs(resume_from, cfg.train.max_epochs)
        keep_global_batch(cfg, resume_from, acc.num_processes, log)
        continue_epoch(cfg, resume_from, acc.num_processes, log)
        check_resume_commits(resume_from.manifest.get("hub_commits") or {}, commits,
                             resume_from.path)  # fmt: skip
    return manager, resume_from, commits


def run_tokenizer(cfg: TrainConfig, out: Path, acc, train_texts):
    """``model.tokenizer``, the pretrained directory's, or a BPE trained on ``train_texts`` (the
    rows ``data.languages`` keeps) once and kept in ``out/tokenizer`` (a resume reuses it).

    The directory appears complete or not at all (atomic), so a kill mid-save cannot leave a
    resume a half-written tokenizer, and the other ranks read rank zero's once it is saved (or
    raise its error: :func:`main_process_first`).
    """
    tok_dir = out / TOKENIZER_DIR
    scratch = cfg.model.tokenizer is None and cfg.model.pretrained is None
    # a tokenizer trained here gets timestamp tokens when the run trains timestamp mode
    stamps = cfg.data.pack.enabled and cfg.data.pack.timestamp_share > 0

    def tokenizer_here():
        if scratch and tok_dir.is_dir():  # a resume's, or the one rank zero just saved
            return load_tokenizer(tok_dir)
        if not acc.is_main_process:
            if scratch:  # rank zero trained and saved it; another BPE would be another model
                raise UserError(
                    f"{tok_dir}: the tokenizer rank zero saved is not there: every process of a "
                    "run must see its output_dir (a shared file system)"
                )
            return build_tokenizer(cfg.model, train_texts, timestamps=stamps)
        # The texts are read first because a stream counts its languages on that same pass.
        texts = list(train_texts) if scratch else train_texts
        # a filter that leaves no row is the data's error, named as the data sets would name it
        if scratch and not texts and (problem := train_texts.nothing_kept()) is not None:
            raise problem
        languages = train_texts.languages() if scratch else ()
        tokenizer = build_tokenizer(cfg.model, texts, timestamps=stamps, languages=languages)
        with atomic_directory(tok_dir) as tmp:
            save_tokenizer(tokenizer, tmp)
        return tokenizer

    return main_process_first(acc, tokenizer_here)


def build_run_model(
    cfg: TrainConfig,
    tokenizer,
    resume_from: TrainingCheckpoint | None,
    precision: str,
    device: torch.device,
) -> tuple[BuiltModel, str | None]:
    """The model, and with ``model.lora`` its adapters (added before the optimizer exists: it
    sees only them) and the base weights' fingerprint, checked against a resumed checkpoint's.

    With ``model.lora.quantize_base`` the fingerprint is the full-precision base's (what export
    merges into), which is then loaded again quantized onto ``device`` for ``precision``.
    """
    bundle = build_model(cfg.model, tokenizer, cfg.seed, language_tokens=cfg.data.language_tokens)
    if cfg.model.lora is None:
        return bundle, None
    lora_base = lora.base_fingerprint(bundle.model)
    if resume_from is not None:
        lora.check_base(resume_from.manifest.get(lora.BASE_KEY), lora_base, resume_from.path)
    if quantize := cfg.model.lora.quantize_base:
        del bundle  # the full-precision copy is not kept next to the quantized one
        bundle = build_model(
            cfg.model,
            tokenizer,
            cfg.seed,
            language_tokens=cfg.data.language_tokens,
            quantization=quantization_config(quantize, precision),
            device=device,
        )
        prepare_for_training(bundle.model, cfg.model.gradient_checkpointing)
        log.info("model: base loaded %s (bitsandbytes), LoRA adapters in fp32", quantize)
    lora.add_adapters(bundle.model, cfg.model.lora)
    return bundle, lora_base


def build_run_selector(
    cfg: TrainConfig, langs: Counter, n_params: tuple[int, int] | None = None
) -> tuple[Selector, int]:
    """The selection policy for the run's language, and the run's step count: ``train.max_steps``
    or the selection group's lower cap. ``n_params``: the model's (all, trainable) parameters,
    which a LoRA run's selection line names (only its adapters train)."""
    language, rule = run_language(cfg, langs)
    # only part of the model trains: a frozen encoder part, or LoRA adapters on a frozen base
    partial = cfg.model.trained_top_encoder_layers is not None or cfg.model.lora is not None
    trains = None
    if cfg.model.lora is not None and n_params is not None:
        trains = f"LoRA: the adapters train, {n_params[1]:,} of {n_params[0]:,} parameters"
    selector = build_selector(
        cfg.selection, language, partial, guard=cfg.eval.guard, trains=trains, chosen_by=rule
    )
    log.info("selection: %s", selector.why)
    if warning := mixed_groups(cfg, langs, language, rule):
        log.warning(warning)
    if cfg.selection.language is not None and unheard_languages(
        [cfg.selection.language], langs, "selection.language"
    ):
        log.warning("selection.language %s: no usable clip of the training split is in it; its "
                    "group's policy picks the checkpoints of a run on %s", cfg.selection.language,
                    ", ".join(sorted(map(str, langs))))  # fmt: skip
    max_steps = cfg.train.max_steps
    if selector.max_steps is not None and selector.max_steps < max_steps:
        log.info(
            "max_steps capped at %d by the selection group (train.max_steps=%d)",
            selector.max_steps,
            max_steps,
        )
        max_steps = selector.max_steps
    for warning in plan_warnings(cfg, max_steps, selector.patience):
        log.warning(warning)
    return selector, max_steps
