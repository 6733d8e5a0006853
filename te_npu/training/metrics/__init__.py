"""What a run reports: the step lines and ``metrics.jsonl`` (``log``: ``MetricsLogger``, with
optional TensorBoard and peak memory), the training curves (``plots``: one PNG of one or several
runs) and throughput as the field reports it (``throughput``: model FLOPs per token, TFLOP/s
per device, MFU). Nothing here reads a model or a device value beyond the peak-memory counter.
"""
