"""torchrun, with the workers' exit code and a one-line failure summary.

    python -m te_npu.training.launch <torchrun arguments> -m models.deepseek_v3.pretrain ...

Runs ``torch.distributed.run`` (same arguments, same agent) but, when a worker fails,
prints one line instead of torchrun's traceback and failure table (``launch_report``: the first
rank to fail and how -- a rank killed by a signal before the ranks whose collectives then broke;
a SIGBUS / SIGSEGV named with the memory-mapped data file that changed under it, exit 2), and
exits with the first failure's exit code (torchrun itself always exits 1): 2 still means a configuration error,
3 a diverged run, 4 a stalled rank (named by the rank that saw it), 128 + N a signal. The failing rank has printed its own report already
(``te_npu.training.job``); for a configuration error that one line is all the job prints
(torchrun's per-process "failed" / "closing signal" log lines are muted; the summary line
replaces them). A signal to the launcher (Ctrl-C, SIGTERM) is forwarded to the
workers by torchrun; the launcher then exits with 128 + that signal.
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from te_npu.training import launch_report, mapped_files
from te_npu.training.launch_report import exit_code_of

__all__ = ["main", "exit_code_of"]


def main(argv: list[str] | None = None) -> int:
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="te_npu_launch_") as mapped:  # the workers' mapped-file records
        os.environ[mapped_files.ENV] = mapped
        try:
            run(parse_args(argv))
        except ChildFailedError as exc:  # the first rank to fail and how (launch_report), in one line
            line, code = launch_report.summarize(exc.failures, mapped)
            if line is not None:
                print(line, file=sys.stderr, flush=True)
            return code
        except SignalException as exc:
            print(f"launch: {exc.sigval.name} received; the workers were stopped", file=sys.stderr, flush=True)
            return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
