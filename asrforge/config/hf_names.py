"""Hugging Face ``TrainingArguments`` / ``Seq2SeqTrainingArguments``, ms-swift and ESPnet names
and what asrforge calls them, for the hint an unknown config field gets (``learning_rate`` ->
``optim.lr``) and for ``asrforge config hf``.

No aliases: a setting has one name in a config, in ``config.yaml`` of a run and in resume's
comparison. Where the meaning differs (``warmup_ratio`` is a fraction, ``optim.warmup_steps``
a count) the hint says how.
"""

from __future__ import annotations

HF_NAMES: dict[str, str] = {
    "learning_rate": "optim.lr",
    "per_device_train_batch_size": "data.batch_size (utterances per micro-batch per process)",
    "per_device_eval_batch_size": "data.eval_batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "warmup_steps": "optim.warmup_steps",
    "warmup_ratio": "optim.warmup_steps, a number of steps (warmup_ratio x train.max_steps)",
    "lr_scheduler_type": "optim.schedule (cosine, linear or constant)",
    "weight_decay": "optim.weight_decay",
    "adam_beta1": "optim.betas: [beta1, beta2]",
    "adam_beta2": "optim.betas: [beta1, beta2]",
    "adam_epsilon": "optim.eps",
    "max_grad_norm": "optim.clip_grad_norm",
    "num_train_epochs": "train.max_epochs (train.max_steps still caps the run)",
    "max_steps": "train.max_steps",
    "fp16": "train.precision: fp16",
    "bf16": "train.precision: bf16",
    "tf32": "train.precision (no separate tf32 switch)",
    "use_cpu": "train.device: cpu",
    "no_cuda": "train.device: cpu",
    "seed": "seed (at the top level)",
    "logging_steps": "train.log_every",
    "eval_steps": "eval.eval_steps",
    "eval_strategy": "eval.eval_steps (every N steps; null: only at the end)",
    "eval_on_start": "eval.at_start (default: on for model.pretrained)",
    "evaluation_strategy": "eval.eval_steps (every N steps; null: only at the end)",
    "save_steps": "checkpoint.checkpoint_every",
    "save_strategy": "checkpoint.save_on_eval and checkpoint.checkpoint_every",
    "save_total_limit": "checkpoint.save_total_limit",
    "load_best_model_at_end": "nothing to set: checkpoints/best is always kept and export uses it",
    "optim": "optim.optimizer (adamw_torch, adamw_torch_fused -> adamw; adamw_8bit, "
    "adamw_bnb_8bit -> adamw_8bit)",
    "metric_for_best_model": "selection.policy (by_wer, by_loss, combined_gate) and "
    "checkpoint.keep_best[].metric",
    "greater_is_better": "checkpoint.keep_best[].mode (min or max)",
    "early_stopping_patience": "selection.patience, or callbacks: [{name: early_stopping}]",
    "gradient_checkpointing": "model.gradient_checkpointing",
    "dataloader_num_workers": "data.num_workers",
    "predict_with_generate": "nothing to set: evaluation always decodes (greedy) and reports WER",
    "generation_max_length": "eval.max_new_tokens",
    "report_to": "callbacks: [{name: tensorboard}, {name: wandb}, {name: mlflow}, ...]",
    "logging_dir": "output_dir (tensorboard/ is written under it)",
    "resume_from_checkpoint": "--resume on the command line (asrforge train CONFIG --resume)",
    "output_dir": "output_dir (at the top level)",
    "model_name_or_path": "model.pretrained (a Hub id or a local directory)",
    "push_to_hub": "nothing to set: export uploads the bundle it writes (asrforge export RUN "
    "--out BUNDLE --push-to-hub REPO)",
    # WhisperConfig's SpecAugment switches, which users set on the model
    "apply_spec_augment": "data.augment.spec_augment ({} for LibriSpeech's LD policy)",
    "mask_time_prob": "data.augment.spec_augment.time_masks and time_width (counts, not a "
    "probability)",
    "mask_time_length": "data.augment.spec_augment.time_width",
    "mask_feature_prob": "data.augment.spec_augment.freq_masks and freq_width",
    "mask_feature_length": "data.augment.spec_augment.freq_width",
}

SWIFT_NAMES: dict[str, str] = {
    "log_freq": "train.log_every",
    "log_to_file": "nothing to set: every run writes its log file in output_dir",
    "master_only": "nothing to set: only rank zero logs and writes files",
    "log_dir": "output_dir (the run's log, metrics and tensorboard/ are written under it)",
    "save_on_best": "nothing to set: checkpoints/best always holds the step the selection "
    "policy chose (checkpoint.save_on_eval saves at every evaluation)",
    "save_steps": HF_NAMES["save_steps"],
    "metric_for_best_model": HF_NAMES["metric_for_best_model"],
    "greater_is_better": HF_NAMES["greater_is_better"],
    "quant_bits": "model.lora.quantize_base (4bit or 8bit; bitsandbytes)",
    "quant_method": "model.lora.quantize_base (bitsandbytes is the only method)",
}
"""ms-swift's names, for users who bring an ms-swift config (several are Hugging Face's too)."""


ESPNET_NAMES: dict[str, str] = {
    "max_epoch": HF_NAMES["num_train_epochs"],
    "accum_grad": "train.grad_accum",
    "grad_clip": "optim.clip_grad_norm",
    "use_amp": "train.precision: fp16 or bf16 (auto picks bf16 where it is faster)",
    "train_dtype": "train.precision",
    "batch_size": HF_NAMES["per_device_train_batch_size"],
    "valid_batch_size": "data.eval_batch_size",
    "num_workers": "data.num_workers",
    "log_interval": "train.log_every",
    "patience": "selection.patience (evaluations without improvement of the selection policy)",
    "early_stopping_criterion": "selection.patience, judged by selection.policy",
    "best_model_criterion": HF_NAMES["metric_for_best_model"],
    "keep_nbest_models": "checkpoint.keep_best[].k (checkpoint.save_total_limit keeps the "
    "latest steps)",
    "nbest_averaging_interval": "nothing to set: average the best checkpoints after the run "
    "with asrforge average, or export --weights average",
    "init_param": HF_NAMES["model_name_or_path"],
    "freeze_param": "model.freeze_encoder or model.train_encoder_layers",
    "optim_conf": "optim.lr, optim.betas, optim.eps, optim.weight_decay",
    "scheduler": HF_NAMES["lr_scheduler_type"],
    "scheduler_conf": "optim.warmup_steps and optim.min_lr_ratio",
    "specaug": "data.augment.spec_augment",
    "specaug_conf": "data.augment.spec_augment.freq_masks, freq_width, time_masks, time_width",
    "use_lora": "model.lora ({} for the defaults)",
    "use_wandb": "callbacks: [{name: wandb}]",
    "use_tensorboard": "nothing to set: every run writes tensorboard/ under output_dir",
    "ngpu": "nothing to set: start one process per GPU with torchrun or accelerate launch",
    "resume": HF_NAMES["resume_from_checkpoint"],
}
"""ESPnet2's ``asr_train`` names, for users who bring an ESPnet training config."""

PEER_NAMES: dict[str, str] = HF_NAMES | SWIFT_NAMES | ESPNET_NAMES
"""Every peer's names with what asrforge calls them (a name two peers share means the same)."""


NOTHING = "nothing to set: "
"""How a table entry starts when asrforge has no setting for the name (it says why)."""


def hf_hint(name: str) -> str | None:
    """The hint for a Hugging Face, ms-swift or ESPnet argument name, or None when ``name`` is
    none of theirs."""
    where = PEER_NAMES.get(name)
    if where is None:
        return None
    owners = [peer for peer, names in PEERS.items() if name in names]
    whose = " and ".join(f"{peer}'s" for peer in owners)
    if where.startswith(NOTHING):
        return f"{whose} {name} has no asrforge setting: {where.removeprefix(NOTHING)}"
    return f"{whose} {name}; asrforge calls this {where}"


PEERS = {"Hugging Face": HF_NAMES, "ms-swift": SWIFT_NAMES, "ESPnet": ESPNET_NAMES}
"""Each peer's names, in the order a hint names the peers."""


def flag_hint(flag: str) -> str:
    """The hint for a command-line flag where asrforge takes a ``key=value`` override
    (``--learning_rate`` -> ``optim.lr=...``)."""
    name = flag.lstrip("-").partition("=")[0].replace("-", "_")
    hint = hf_hint(name)
    said = f"config overrides are key=value without dashes (e.g. optim.lr=1e-5), not {flag}"
    return f"{said}; {hint}" if hint else said
