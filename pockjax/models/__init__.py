"""Flax NNX models of the paper: MobileNetV2, a LLaMA-family decoder (LLaMA, Mistral and
Qwen2, with a Hugging Face checkpoint loader and cached generation), and LoRA adapters as
the baseline method."""
from pockjax.models.hf import SUPPORTED_FAMILIES, load_llama, save_llama
from pockjax.models.llama import KVCache, Llama, LlamaConfig, generate, num_params
from pockjax.models.lora import LoRALinear, apply_lora, merge_lora
from pockjax.models.mobilenetv2 import MobileNetV2

__all__ = ["MobileNetV2", "Llama", "LlamaConfig", "KVCache", "generate", "num_params",
           "load_llama", "save_llama", "SUPPORTED_FAMILIES", "LoRALinear", "apply_lora",
           "merge_lora"]
