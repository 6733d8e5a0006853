"""Exceptions raised by te_npu. Each message names the field, FQN or shape at fault."""


class ConfigError(ValueError):
    """A configuration value is not supported; raised before any model is built."""


class LowPrecisionUnavailableError(RuntimeError):
    """A low-precision GEMM or quantization cannot run here (device, op or shape).

    te_npu never falls back to a high-precision GEMM: it raises this instead.
    """


def exception_chain(exc: BaseException | None) -> list[BaseException]:
    """``exc`` and every exception behind it, in order: its ``__cause__`` / ``__context__``
    chain and, for ``torch.distributed.checkpoint``'s ``CheckpointException``, the exceptions
    each rank reported in its ``failures`` (a rank's error arrives wrapped there)."""
    return _chain(exc, set())


def _chain(exc: BaseException | None, seen: set) -> list[BaseException]:
    out = []
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(exc)
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                inner = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(inner, BaseException):
                    out.extend(_chain(inner, seen))
        exc = exc.__cause__ or exc.__context__
    return out
