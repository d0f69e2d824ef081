"""bitsandbytes in asrforge: a LoRA run's base held quantized (``model.lora.quantize_base``),
and the one import both low-bit options (this and ``optim.optimizer: adamw_8bit``) go through.

transformers loads the base quantized (``BitsAndBytesConfig``): its linear layers become
bitsandbytes' ``Linear4bit`` (NF4 codes, one scale per block of 64 weights, the scales
quantized again) or ``Linear8bitLt`` (LLM.int8); the embeddings, convolutions, norms and the
output projection (tied to the token embedding) stay fp32. A 4-bit layer dequantizes its block
to the compute dtype, the run's precision, for each matmul; LLM.int8 multiplies in fp16.
"""

from __future__ import annotations

import logging

import torch
from transformers import BitsAndBytesConfig

from asrforge.errors import UserError
from asrforge.model.dtypes import precision_dtype


def bitsandbytes(option: str):
    """The bitsandbytes module, imported by runs that ask for it (it loads native kernels).

    Raises:
        UserError: naming ``option`` (the setting that needs it) and the extra to install.
    """
    try:
        import bitsandbytes
    except ImportError:
        raise UserError(
            f"{option} needs the bitsandbytes package (pip install 'asrforge[lowbit]')"
        ) from None
    return bitsandbytes


def import_quietly() -> None:
    """Import bitsandbytes, when it is installed, with its import-time log messages silenced.

    peft imports it for any LoRA model; on a CPU without its optional kernels it warns ("Failed to
    load CPU gemm_4bit_forward ...") about a 4-bit path a run that is not low-bit never takes.
    """
    # bitsandbytes looks for the kernel through the `kernels` package, which warns too
    loggers = [logging.getLogger(name) for name in ("bitsandbytes", "kernels")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        pass
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def quantization_config(quantize: str, precision: str) -> BitsAndBytesConfig:
    """transformers' config for loading a base ``quantize`` (``4bit`` or ``8bit``) for a run in
    ``precision`` (``train.precision`` resolved: no, fp32, bf16 or fp16).

    Raises:
        UserError: bitsandbytes is missing.
    """
    bitsandbytes(f"model.lora.quantize_base: {quantize}")
    if quantize == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=precision_dtype(precision),
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def prepare_for_training(model: torch.nn.Module, gradient_checkpointing: bool) -> None:
    """peft's preparation of a quantized base: every weight frozen, any half-precision one that
    is not quantized (norms, embeddings) cast to fp32, and with ``gradient_checkpointing`` the
    inputs made to require grad so checkpointed blocks back-propagate to the adapters."""
    # peft is the lora extra's; a quantized base is only loaded for LoRA, which imported it
    from peft import prepare_model_for_kbit_training

    prepare_model_for_kbit_training(
        model,
        use_gradient_checkpointing=gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    # On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit weight for a bf16 inference kernel
    # at its first forward without gradients (an evaluation); training forwards then fail on the
    # repacked weight, and evaluation would not measure the arithmetic training uses.
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def stored_numel(p: torch.Tensor) -> int:
    """The number of weights ``p`` stands for: a 4-bit parameter packs two in each byte and says
    its real shape in its quantization state."""
    quant_state = getattr(p, "quant_state", None)
    return quant_state.shape.numel() if quant_state is not None else p.numel()
