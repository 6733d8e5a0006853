"""What a run reports: the step lines and ``metrics.jsonl`` (``log``: ``MetricsLogger``, with
optional TensorBoard and peak memory), the training curves (``plots``: one PNG of one or several
runs) and throughput as the field reports it (``throughput``: model FLOPs per token, TFLOP/s
per device, MFU); ``host_rss`` reads this process's RSS and its resettable peak (Linux /proc).
Nothing here reads a model or a device value beyond the peak-memory counter.
"""
