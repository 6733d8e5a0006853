"""torchrun, with the workers' exit code and a one-line failure summary.

    python -m te_npu.training.launch <torchrun arguments> -m models.deepseek_v3.pretrain ...

Runs ``torch.distributed.run`` (same arguments, same agent) but, when a worker fails,
prints one line instead of torchrun's traceback and failure table, and exits with the first
failure's exit code (torchrun itself always exits 1): 2 still means a configuration error,
3 a diverged run, 4 a stalled rank (named by the rank that saw it), 128 + N a signal. The failing rank has printed its own report already
(``te_npu.training.job``); for a configuration error that one line is all the job prints
(torchrun's per-process "failed" / "closing signal" log lines are muted; the summary line
replaces them). A signal to the launcher (Ctrl-C, SIGTERM) is forwarded to the
workers by torchrun; the launcher then exits with 128 + that signal.
"""
from __future__ import annotations

import logging
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

__all__ = ["main", "exit_code_of"]


def exit_code_of(exitcode: int) -> int:
    """A worker's ``exitcode`` (negative: killed by that signal) as a shell exit status."""
    return 128 - exitcode if exitcode < 0 else exitcode


def main(argv: list[str] | None = None) -> int:
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = exit_code_of(failure.exitcode)
        if code == 2:
            return code  # a ConfigError: the worker's one line says it all
        if failure.exitcode < 0:  # no report: the process was killed
            print(f"launch: the job failed: rank {rank} was killed by {signal.Signals(-failure.exitcode).name}",
                  file=sys.stderr, flush=True)
        else:
            print(f"launch: the job failed with exit code {code} (the failing rank's report is above)",
                  file=sys.stderr, flush=True)
        return code
    except SignalException as exc:
        print(f"launch: {exc.sigval.name} received; the workers were stopped", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
