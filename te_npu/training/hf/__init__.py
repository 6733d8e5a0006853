"""Hugging Face weights for a run: ``weights`` is the Trainer's HF path (start from an HF
directory: check it before the build, read each rank's shards into the FP32 masters; export the
masters at the end), ``convert`` the offline converters between a run's DCP steps and HF
directories (``scripts/convert_checkpoint.py``). The files themselves (safetensors through
DCP's HF reader / writer, the key map, the layout) are ``te_npu.distributed.storage``'s.
"""
