"""torchrun, with the workers' exit code and a one-line failure summary.

    python -m te_npu.training.launch <torchrun arguments> -m models.deepseek_v3.pretrain ...

Runs ``torch.distributed.run`` (same arguments, same agent) but, when a worker fails,
prints one line instead of torchrun's traceback and failure table (``launch_report``: the first
rank to fail and how -- a rank killed by a signal before the ranks whose collectives then broke;
a SIGBUS / SIGSEGV named with the memory-mapped data file that changed under it, exit 2), and
exits with the first failure's exit code (torchrun itself always exits 1): 2 still means a configuration error,
3 a diverged run, 4 a stalled rank (named by the rank that saw it) or a lost node, 128 + N a signal. The failing rank has printed its own report already
(``te_npu.training.job``); for a configuration error that one line is all the job prints
(torchrun's per-process "failed" / "closing signal" log lines are muted; the summary line
replaces them). A signal to the launcher (Ctrl-C, SIGTERM) is forwarded to the
workers by torchrun; the launcher then exits with 128 + that signal. Started by
``te_npu.process_tree.start_owned`` (``scripts/q3_acceptance.py`` does), the launcher and its
process group die with their owner, even after ``kill -9`` of it; its workers (torchrun gives
each a session of its own) see the launcher gone (``LAUNCHER_PID_ENV``, then
``PR_SET_PDEATHSIG`` and a parent-pid poll in ``te_npu.training.job``) and exit within a second.

Multi-node (``--nnodes N --node_rank K --master_addr A --master_port P``, torchrun's static
rendezvous: node 0's launcher hosts the job's store at ``A:P``; every node runs its own launcher
with the same arguments but its ``--node_rank``). When another node is lost (its launcher killed,
its host down) this node's ranks see their collectives break, name the lost node from their
heartbeats (``te_npu.training.guards.stall``) and leave that line here; this launcher prints it as its
one-line summary and exits 4: ``launch: node 1 (ranks 2-3, host h) lost: connections closed and
the processes of ranks 2-3 ended; rank 0 was in iteration 4, forward/backward; ending the job
(exit 4)`` (node 0 lost: "the job's store ... no longer answers"). A node that hangs without
closing its connections is the stall watch's (``training.collective_timeout_s``), exit 4 too.
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from te_npu import process_tree
from te_npu.training import launch_report, mapped_files
from te_npu.training.launch_report import exit_code_of

__all__ = ["main", "exit_code_of", "LAUNCHER_PID_ENV"]

LAUNCHER_PID_ENV = "TE_NPU_LAUNCHER_PID"
"""The launcher's pid, for its workers: a worker whose parent is no longer it exits (even one
that starts after the launcher died, which ``PR_SET_PDEATHSIG`` alone would miss)."""


def main(argv: list[str] | None = None) -> int:
    process_tree.watch_owner()  # started by an owner (start_owned): die with it
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
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
