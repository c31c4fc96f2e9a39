"""The one error boundary of every entry point: command-line tools (`entry_point`) and Hydra runs (`hydra_entry`).

Not the command line itself: that is `python -m eagle_lite.generate` (eagle_lite/generate.py), and the flags it shares
with the server and the eval tools are eagle_lite/options.py's.

What a user can cause ends in one line on stderr and an exit status, never a traceback:
  1    an error: a missing or damaged file, a full or read-only disk (OSError, named with its errno), a setting no
       model can take (ValueError), a failed load (RuntimeError)
  2    a bad argument: a flag or override checked inside `arguments()`, or a Hydra override that does not compose
  130  Ctrl-C (128 + SIGINT); SIGTERM is handled as Ctrl-C is, with 143 (128 + SIGTERM), so work in progress is
       kept the same way
  0    the reader of stdout went away (`... | head`): stdout is pointed at /dev/null and the program ends quietly,
       as `cat` does
Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import errno
import functools
import os
import select
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

ERROR, USAGE, STOPPED, TERMINATED = 1, 2, 130, 143
EXPECTED = (ValueError, OSError, RuntimeError)
# what to do about an OSError, by errno: the disk's state is the user's to change, and the run resumes after it
HINTS = {
    errno.ENOSPC: "free some space and run the same command again: finished work is kept",
    errno.EDQUOT: "free some space and run the same command again: finished work is kept",
    errno.EROFS: "the file system is read-only: choose a writable folder",
    errno.EACCES: "choose a folder you can write to",
    errno.EPERM: "choose a folder you can write to",
}


class UsageError(ValueError):
    """A flag or setting that is wrong whatever the model: exit status 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be so that the same code keeps what was finished: exit status 143."""


@contextmanager
def arguments() -> Iterator[None]:
    """The checks of the command line: a ValueError raised inside is a bad argument (exit status 2)."""
    try:
        yield
    except UsageError:
        raise
    except ValueError as err:
        raise UsageError(str(err)) from err


def one_line(err: BaseException) -> str:
    """The error as one line: an OSError as what failed, on which file, and what to do about it."""
    if isinstance(err, OSError) and err.errno is not None and err.strerror:
        name = errno.errorcode.get(err.errno, str(err.errno))
        where = f" {err.filename}" if err.filename is not None else ""
        if err.filename2 is not None:
            where += f" -> {err.filename2}"
        hint = HINTS.get(err.errno)
        return f"{err.strerror} ({name}):{where}" + (f"; {hint}" if hint else "")
    text = " ".join(str(err).split())
    text = text.split(" Config search path:")[0]   # Hydra's missing-config message: the options, not where it looked
    return text or type(err).__name__


def is_usage(err: BaseException) -> bool:
    """A bad argument: ours, or a Hydra override / config key that does not compose (without importing Hydra)."""
    if isinstance(err, UsageError):
        return True
    return type(err).__module__.split(".")[0] in ("hydra", "omegaconf")


def reader_gone(stream) -> bool:
    """Whether `stream` is a pipe whose reader has closed it (poll reports an error on its write end)."""
    try:
        poller = select.poll()
        poller.register(stream.fileno(), select.POLLOUT)
        return any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def quiet_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered for the departed reader goes nowhere, without the
    interpreter's 'Exception ignored ... BrokenPipeError' at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):
        pass
    finally:
        os.close(devnull)


def say(line: str) -> None:
    """One line on stderr; a stderr that is gone too is no reason for a traceback."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _terminate(signum, frame) -> None:
    raise Terminated()


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises `Terminated` (a KeyboardInterrupt) while inside: what Ctrl-C keeps, a kill keeps too."""
    try:
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:   # not the main thread: signals stay as they are
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(main: Callable[[], int | None], stopped: str = "[stopped]") -> int:
    """Call `main()` and return the exit status (its own, or the boundary's for what it raised)."""
    try:
        with sigterm_as_interrupt():
            status = main()
            sys.stdout.flush()   # a reader that left after the last write is found here, not at exit
        return int(status or 0)
    except BrokenPipeError as err:
        if reader_gone(sys.stdout):
            quiet_stdout()
            return 0
        say(f"error: {one_line(err)}")
        return ERROR
    except KeyboardInterrupt as err:
        say(f"\n{stopped}")
        return TERMINATED if isinstance(err, Terminated) else STOPPED
    except Exception as err:
        if is_usage(err):
            say(f"error: {one_line(err)}")
            return USAGE
        if isinstance(err, EXPECTED):
            say(f"error: {one_line(err)}")
            return ERROR
        raise


def entry_point(main: Callable[..., int | None] | None = None, *, stopped: str = "[stopped]"):
    """Decorate a tool's `main(argv=None)`: it returns the exit status, whatever was raised inside."""
    def wrap(func):
        @functools.wraps(func)
        def wrapped(*args, **kwargs) -> int:
            return run(lambda: func(*args, **kwargs), stopped)
        return wrapped
    return wrap(main) if main is not None else wrap


class _WithoutHydraJobLine:
    """stderr less the line Hydra writes before it raises what a job raised ("Error executing job with overrides:
    [...]"): the boundary's own line says what failed, and that line is all a user's mistake prints."""

    LINE = "Error executing job with overrides:"

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return len(text) if text.startswith(self.LINE) else self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def hydra_entry(hydra_main: Callable[[], None], stopped: str = "[stopped]") -> int:
    """Run a `@hydra.main` function under the boundary. HYDRA_FULL_ERROR makes Hydra raise what failed, in its own
    set-up too (a run folder it cannot create), instead of printing a trimmed traceback itself."""
    previous, stderr = os.environ.get("HYDRA_FULL_ERROR"), sys.stderr
    os.environ["HYDRA_FULL_ERROR"] = "1"
    sys.stderr = _WithoutHydraJobLine(stderr)
    try:
        return run(hydra_main, stopped)
    finally:
        if sys.stderr.__class__ is _WithoutHydraJobLine:
            sys.stderr = stderr
        if previous is None:
            del os.environ["HYDRA_FULL_ERROR"]
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous
