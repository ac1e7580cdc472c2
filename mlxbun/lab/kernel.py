"""The kernel `mlxbun lab run` starts by default: ipykernel on this interpreter, less one
misleading log line (`python -m mlxbun.lab.kernel -f CONNECTION_FILE`, as ipykernel_launcher).

jupyter_client interrupts a kernel (SIGINT) just before it asks it to shut down. When the signal
lands while the kernel is still finishing its last reply, ipykernel logs "KeyboardInterrupt
caught in kernel" to its stderr, which is the terminal of `mlxbun lab run`, after a run that went
well. That record is dropped and nothing else: every other kernel log line still prints, a cell's
error is in the executed notebook, and a kernel that dies fails the run.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

__all__ = ["ShutdownInterruptFilter", "main"]


class ShutdownInterruptFilter(logging.Filter):
    """Drops ipykernel's "KeyboardInterrupt caught in kernel" record (the shutdown's SIGINT)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("KeyboardInterrupt caught in kernel")


def main() -> None:
    # as ipykernel_launcher: the working directory leaves sys.path while ipykernel loads (the
    # shell puts it back)
    if sys.path and (sys.path[0] == "" or Path(sys.path[0]) == Path.cwd()):
        del sys.path[0]
    from ipykernel.kernelapp import IPKernelApp

    # the application's logger (traitlets names it after the class); the kernel logs through it
    logging.getLogger(IPKernelApp.__name__).addFilter(ShutdownInterruptFilter())
    IPKernelApp.launch_instance()


if __name__ == "__main__":
    main()
