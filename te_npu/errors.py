"""Exceptions raised by te_npu. Each message names the field, FQN or shape at fault."""


class ConfigError(ValueError):
    """A configuration value is not supported; raised before any model is built."""


class LowPrecisionUnavailableError(RuntimeError):
    """A low-precision GEMM or quantization cannot run here (device, op or shape).

    te_npu never falls back to a high-precision GEMM: it raises this instead.
    """
