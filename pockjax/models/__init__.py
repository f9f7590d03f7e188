"""Flax NNX models of the paper: MobileNetV2, a LLaMA-family decoder, and LoRA."""
