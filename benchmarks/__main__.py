"""`python -m benchmarks [paper|profile|sparse_grad|train_step|export|real_size|matmul_peak|remat_table|finetune_speed|pretrain|quality|gpu|prefix_cache|moments|lowbit_load|frozen_formats|cache_quality|edge_speed|device_job|logits_targets|gguf_real|tf_peer|sharded_memory|onnx_node_cases] [args...]`: run one benchmark."""
import runpy
import sys

SCRIPTS = {"paper": "paper_table", "profile": "profile_step", "sparse_grad": "sparse_grad", "train_step": "train_step",
           "export": "export", "real_size": "real_size", "matmul_peak": "matmul_peak",
           "remat_table": "remat_table", "finetune_speed": "finetune_speed",
           "pretrain": "pretrain", "quality": "quality", "gpu": "gpu",
           "prefix_cache": "prefix_cache", "moments": "moments",
           "lowbit_load": "lowbit_load",
           "frozen_formats": "frozen_formats", "cache_quality": "cache_quality",
           "edge_speed": "edge_speed", "device_job": "device_job",
           "logits_targets": "logits_targets", "gguf_real": "gguf_real", "tf_peer": "tf_peer", "onnx_node_cases": "onnx_node_cases",
           "sharded_memory": "sharded_memory"}

if len(sys.argv) < 2 or sys.argv[1] not in SCRIPTS:
    sys.exit(f"usage: python -m benchmarks {{{'|'.join(SCRIPTS)}}} [args...]")
name = SCRIPTS[sys.argv[1]]
sys.argv = [f"benchmarks/{name}.py"] + sys.argv[2:]
runpy.run_module(f"benchmarks.{name}", run_name="__main__")
