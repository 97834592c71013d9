"""``polyaccel-asr``: transcribe, score, benchmark, compile and convert from the command line.

Exit status: 0 when every input has a transcript; 2 for usage errors (bad arguments, unknown
model or backend, no inputs, an output that may not be written), with nothing written. Under
``transcribe``: 1 when some files failed (their lines say why) or the run stopped early, 3 when
nothing was transcribed (every file failed). Every command: 130 on Ctrl-C, 143 on SIGTERM and
129 on SIGHUP (the terminal closed; not under ``nohup``)
(each unwinds the command: results written so far are kept, its lock is released; a second one
while it unwinds ends the process at once); 141 when the
reader of its output went away (``polyaccel-asr wer ... --per-file | head``), quietly, like a
standard tool; 1 with one line naming it when another pipe it writes broke, or stdout cannot be
written (a full disk).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from polyaccel.core.argtypes import integer, number
from polyaccel.core.clitools import (
    broken_pipe,
    dumps,
    interrupt_status,
    second_ctrl_c_ends_at_once,
    sigterm_as_interrupt,
)

EXAMPLES = """\
examples:
  polyaccel-asr transcribe clips/ -o out.jsonl
  polyaccel-asr transcribe a.wav b.flac --model whisper-base --backend cuda --batch-size 32 -o out.jsonl
  polyaccel-asr transcribe manifest.jsonl -o out.jsonl            # NeMo manifest; its "text" gives WER
  polyaccel-asr transcribe clips/ --refs transcription -o out.jsonl
  polyaccel-asr transcribe clips/ --ray --num-actors 4 -o out.jsonl
  ray job submit --address http://127.0.0.1:8265 -- polyaccel-asr transcribe --ray /data/clips -o /data/out.jsonl
  polyaccel-asr transcribe clips/ --timestamps -o out.jsonl && polyaccel-asr export out.jsonl --format srt -d subs/
  polyaccel-asr wer --refs transcription --hyps out.jsonl
  polyaccel-asr bench clips/*.wav --batch-sizes 1,8,32
  polyaccel-asr convert path/to/ct2_model ./whisper-hf

JSON printed or written is strict (NaN/infinity as null). A reader of the output that goes away
(`| head`) ends any command quietly with status 141.
"""

TRANSCRIBE_HELP = """\
Transcribe audio files, directories (searched recursively) or JSONL manifests into a JSONL file
with one line per input: {"path", "text", "duration_s", "error", "windows", "model", "rtfx", ...}.
Lines are written in input order as results arrive. Rerunning with the same -o resumes: files
already transcribed without error are skipped, failed ones are retried, a torn last line is
repaired. Audio longer than the model's window (30 s for Whisper) is cut into overlapping
windows and stitched back. Nothing is written before the model has loaded; an existing -o that
is not a results file, or that is one of the inputs, is refused. One run at a time per -o (a
results file with other hard links is refused). -o - is refused: results go to a file, not stdout.
A file name that starts with '-' goes after `--`: polyaccel-asr transcribe -o out.jsonl -- -take1.wav

exit status: 0 every input transcribed (now or by an earlier run), 1 some files failed (or the
run stopped early), 2 usage error (nothing written), 3 nothing transcribed (every file failed),
130 interrupted (Ctrl-C), 143 terminated (SIGTERM) or 129 hung up (SIGHUP, the terminal closed):
what was written is kept, rerun to resume;
141 the reader of the output went away (e.g. `| head`).
"""


EXIT_OK, EXIT_SOME_FAILED, EXIT_USAGE, EXIT_NOTHING_DONE = 0, 1, 2, 3
MAX_REPLICAS = 256  # model copies in this process, a thread each: more is a typo, not a setting
MAX_REPEAT = 10_000  # bench --repeat: a list of that many copies of the inputs
MAX_BATCH_SIZE = 65_536  # items per replica batch: up to 4 batches of files are read ahead into memory


class UsageError(Exception):
    """A mistake in how the command was called (exit status 2)."""


class StdoutError(Exception):
    """Standard output could not be written (a full disk; exit status 1)."""


def _emit(record: dict[str, Any]) -> None:
    """Print one JSON line on stdout, flushed; a write error there is a :class:`StdoutError`
    (a reader that went away stays a ``BrokenPipeError``: quiet, 141)."""
    try:
        print(dumps(record), flush=True)
    except BrokenPipeError:
        raise
    except OSError as e:
        raise StdoutError(f"cannot write standard output: {e.strerror or e}") from None


def _output_name(text: str) -> str:
    """An argparse type: a non-empty output file name that is not ``-`` or named like audio."""
    from polyaccel.asr.audio import AUDIO_EXTENSIONS

    if not text or text.endswith(os.sep):
        raise argparse.ArgumentTypeError(f"expected a file name, got {text!r}")
    if text == "-":  # not stdout: a resumable run needs a file to read back (./- names a file)
        raise argparse.ArgumentTypeError("'-' (standard output) is not supported: results are resumed from a "
                                         "file, so give a file name (./- for a file named '-')")
    if os.path.splitext(text)[1].lower() in AUDIO_EXTENSIONS:
        raise argparse.ArgumentTypeError(f"{text!r} is named like an audio file; results are JSONL")
    return text


def _model_name(text: str) -> str:
    """An argparse type: a non-empty model name ("" would load the current folder)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty name (an unset shell variable?); the current folder is ./")
    return text


WER_HELP = """\
Word error rate of a `transcribe` results file against reference texts, both normalized first
(lowercase, no punctuation, numbers spelled out, fillers and [annotations] dropped); files are
matched by path or by file stem. Prints one JSON
line: wer, files scored, reference words, substitutions / deletions / insertions, failed
files and results without a reference (with --per-file, a line per file first).

exit status: 0 scored, 1 standard output could not be written, 2 a usage error (a missing or
unreadable file, --refs and --hyps the same file, nothing to score)."""

BENCH_HELP = """\
Real-time factor of the whole pipeline (audio already decoded into memory, features, model,
text) at each of --batch-sizes, after a warm-up batch: one JSON line per size with the
transcriber's metrics and the number of failed items. Unreadable inputs are skipped with a
message.

exit status: 0 done, 1 standard output could not be written, 2 a usage error (no readable
audio, bad --batch-sizes or one size asked for outside it, an unknown model or backend)."""

COMPILE_HELP = """\
Loads the model and compiles every (graph, shape bucket) for the backend ahead of time, so a
later run starts warm; prints one JSON line (backend, graphs compiled, seconds). The CPU
backend runs eagerly: nothing to compile, said on stderr.

exit status: 0 done (or nothing to compile), 1 standard output could not be written, 2 a usage
error (an unknown or unavailable backend, a model that cannot be loaded)."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for all subcommands."""
    p = argparse.ArgumentParser(prog="polyaccel-asr", description="High-throughput batch speech-to-text.",
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def model_args(sp: argparse.ArgumentParser, batch_size_help: str | None = None) -> None:
        sp.add_argument("--model", default="whisper-tiny.en", type=_model_name,
                        help="model directory (Hugging Face or CTranslate2) or known name "
                             "(whisper-tiny.en, whisper-base; default: %(default)s)")
        sp.add_argument("--backend", default="auto", help="auto, cpu, cuda or neuron (default: %(default)s)")
        sp.add_argument("--replicas", type=integer(1, MAX_REPLICAS), default=None,
                        help="model replicas (default: the backend's: one on the CPU, two per GPU; "
                             f"at most {MAX_REPLICAS})")
        sp.add_argument("--batch-size", type=integer(1, MAX_BATCH_SIZE), default=None,
                        help=batch_size_help or "items per replica batch (default: the backend's: 8 on the CPU, "
                                                f"64 on a GPU; at most {MAX_BATCH_SIZE})")
        sp.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="model dtype (default: the backend's)")
        sp.add_argument("--batch-invariant", action="store_true",
                        help="Whisper in bf16/fp16 on a GPU: the same tokens whatever batch a file lands in "
                             "(kernels that do not change with the batch; slower, measured in docs/asr_whisper.md)")
        sp.add_argument("--fp8-encoder", action="store_true",
                        help="Whisper's encoder GEMMs in FP8 and the decoder's cross-attention K/V in e4m3 "
                             "(row-wise scales; sm_89+ GPUs): ~1.28x bf16's RTFx at batch 16-128 on an H200 "
                             "(large-v3-turbo, large-v3), tokens may differ from bf16's (both measured in "
                             "docs/asr_whisper.md)")

    t = sub.add_parser("transcribe", help="transcribe files to JSONL", description=TRANSCRIBE_HELP,
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("inputs", nargs="+", metavar="INPUT", help="audio files, directories or manifest .jsonl files")
    t.add_argument("-o", "--output", required=True, type=_output_name,
                   help="results JSONL (appended to when resuming; any other existing file is refused, "
                        "and so is one with other hard links; '-' is refused: no results on stdout)")
    model_args(t)
    t.add_argument("--refs", help="reference texts: JSONL {path|id, text} or Sphinx '<s> text </s> (id)' lines")
    t.add_argument("--overwrite", action="store_true",
                   help="start the results file afresh instead of resuming (replaced when the first file is "
                        "transcribed: a run in which every file fails leaves it as it was)")
    t.add_argument("--overlap", type=number(0), default=3.0, help="seconds of overlap between long-audio windows (default: 3; at most half a window, 15 s for Whisper)")
    t.add_argument("--no-speech-threshold", type=number(0), default=None, metavar="P",
                   help="Whisper: a window whose no-speech probability is above P (0-1; e.g. 0.6) gets no text, "
                        "instead of what Whisper makes up for silence or noise (\"you\"); default: off")
    t.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    t.add_argument("--timestamps", action=argparse.BooleanOptionalAction, default=False,
                   help="decode with Whisper's timestamp tokens: each line gets \"segments\" "
                        "[{start, end, text}] in seconds (for `export --format srt|vtt`; default: off)")
    t.add_argument("--ray", action="store_true", help="run as a Ray Data job (an actor per device)")
    t.add_argument("--address", default=None,
                   help="with --ray: Ray cluster address (default: RAY_ADDRESS, the job's cluster under `ray job submit`, "
                        "else, or with 'local', a private in-process cluster on loopback; 'auto' is refused: "
                        "it joins whatever cluster a local user advertises)")
    t.add_argument("--num-actors", type=integer(1), default=None, help="with --ray: Ray actors (default: one per device/node)")

    fmt = argparse.RawDescriptionHelpFormatter
    w = sub.add_parser("wer", help="word error rate of a results file against references", formatter_class=fmt,
                       description=WER_HELP)
    w.add_argument("--refs", required=True, help="JSONL {path|id, text} or Sphinx transcription file")
    w.add_argument("--hyps", required=True, help="results JSONL written by `transcribe`")
    w.add_argument("--per-file", action="store_true", help="also print one JSON line per file")

    b = sub.add_parser("bench", help="RTFx at several batch sizes (one JSON line each)", formatter_class=fmt,
                       description=BENCH_HELP)
    b.add_argument("inputs", nargs="+", metavar="INPUT", help="audio files, directories or manifests")
    model_args(b, batch_size_help=argparse.SUPPRESS)  # refused: --batch-sizes says which sizes run
    b.add_argument("--batch-sizes", default="1,4,8",
                   help="comma-separated batch sizes to run, one JSON line each (default: %(default)s)")
    b.add_argument("--repeat", type=integer(1, MAX_REPEAT), default=1,
                   help=f"use the inputs this many times (fills large batches; at most {MAX_REPEAT})")

    c = sub.add_parser("compile", help="compile every shape bucket ahead of time", formatter_class=fmt,
                       description=COMPILE_HELP)
    model_args(c)

    from polyaccel.asr.export import add_parser as add_export_parser

    add_export_parser(sub)
    sub.add_parser("convert", help="convert a CTranslate2 Whisper model to a Hugging Face directory",
                   add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    _fill_closed_standard_streams()
    try:
        with sigterm_as_interrupt(), second_ctrl_c_ends_at_once():
            return _main(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError as e:  # `... | head`: the reader left (141, no traceback); another pipe: exit 1
        return broken_pipe(e, "polyaccel-asr")


def _fill_closed_standard_streams() -> None:
    """Open the null device on a closed stdin, stdout or stderr (``2>&-``): else the first file
    the run opens (the output's lock) takes that descriptor and C libraries' warnings are written
    into it, and Python has no ``sys.stderr`` for the progress bar and messages."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: this one
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))


def _main(argv: list[str]) -> int:
    if argv and argv[0] == "convert":  # its own parser (owned by the converter module)
        from polyaccel.asr.ct2_convert import main as convert_main

        try:
            return convert_main(argv[1:])
        except KeyboardInterrupt as e:  # its temporary folder is gone: OUT is complete or absent
            return _interrupted(e, "nothing was converted")
    args = build_parser().parse_args(argv)
    from polyaccel.core.runtime import ReplicaStartError

    try:
        if args.command == "export":
            from polyaccel.asr.export import cmd_export

            return cmd_export(args)
        return {"transcribe": cmd_transcribe, "wer": cmd_wer, "bench": cmd_bench,
                "compile": cmd_compile}[args.command](args)
    except UsageError as e:
        from polyaccel.asr.results_file import printable

        print(f"polyaccel-asr {args.command}: error: {printable(e)}", file=sys.stderr)
        return 2
    except StdoutError as e:
        print(f"polyaccel-asr {args.command}: error: {e}", file=sys.stderr)
        return 1
    except ReplicaStartError as e:  # bench, compile (transcribe says it as a UsageError)
        from polyaccel.asr.results_file import printable

        print(f"polyaccel-asr {args.command}: error: {printable(_not_started(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        return _interrupted(e, "rerun the same command to resume")


def _interrupted(e: KeyboardInterrupt, then: str) -> int:
    """Say that Ctrl-C (130), SIGTERM (143) or SIGHUP (129) ended the command; return its exit status."""
    status, word = interrupt_status(e)
    print(f"{word}; {then}", file=sys.stderr)
    return status


# ---- transcribe -----------------------------------------------------------------------------


def cmd_transcribe(args: argparse.Namespace) -> int:
    """Transcribe inputs into args.output, resuming if it exists; print a summary; return the
    exit status (see the module docstring)."""
    from polyaccel.asr.manifest import attach_refs, read_refs
    from polyaccel.asr.results_file import completed, path_key, printable, record_key

    ray_only = [flag for flag, value in (("--address", args.address), ("--num-actors", args.num_actors))
                if value is not None]
    if ray_only and not args.ray:  # else silently a local run with one process
        raise UsageError(f"{' and '.join(ray_only)} only appl{'ies' if len(ray_only) == 1 else 'y'} to a Ray job: add --ray, or leave them out")
    _refuse_descriptors(args.inputs)
    items = _gather(args.inputs)
    _refuse_descriptors(it.path for it in items)  # a manifest's too
    if args.refs is not None:
        attach_refs(items, _read_refs(args.refs, read_refs))
    out = _check_output(args, items)
    with _locked(out, args.output):
        previous = _previous_results(out, args.output)
        kept = [] if args.overwrite else completed(previous)
        done = {record_key(r) for r in kept}
        todo = [it for it in items if path_key(it.path) not in done]
        skipped = len(items) - len(todo)
        if kept and not todo:  # nothing to run, but not "done" if the file was made another way
            _check_made_alike(kept, args)
        if skipped and not args.quiet:
            print(f"resuming {printable(args.output)}: {skipped} of {len(items)} already done", file=sys.stderr)
        start = time.perf_counter()
        counts = _run(todo, args, out, kept, keep_earlier=args.overwrite and bool(previous))
    return _report(args, counts, skipped, time.perf_counter() - start)


def _check_output(args: argparse.Namespace, items: list[Any]) -> str:
    """The real path of -o, after refusing a directory, a device or FIFO, or one of the inputs
    (audio, manifests, references); nothing is created here."""
    from polyaccel.asr.results_file import output_problem

    protected = [it.path for it in items] + [s for s in args.inputs if os.path.isfile(s)]
    protected += [args.refs] if args.refs else []
    problem = output_problem(args.output, protected)
    if problem:
        raise UsageError(f"-o {args.output}: {problem}")
    real = os.path.realpath(args.output)
    from polyaccel.asr.audio import AUDIO_EXTENSIONS

    if os.path.splitext(real)[1].lower() in AUDIO_EXTENSIONS:  # a symlink, dangling or not, to one
        raise UsageError(f"-o {args.output}: leads to {real}, named like an audio file; results are JSONL")
    return real


class _locked:
    """Hold the run's lock on ``out`` (creating missing parent folders for its lock file, and
    removing them again, with an output file this run created, if the run wrote nothing)."""

    def __init__(self, out: str, shown: str):
        self.out, self.shown, self.lock, self.made, self.existed = out, shown, None, [], True

    def __enter__(self) -> None:
        from polyaccel.asr.results_file import OutputBusy, OutputLock

        self.made = _make_parents(os.path.dirname(self.out), self.shown)
        self.lock = OutputLock(self.out)
        try:
            self.lock.acquire()
            self.existed = os.path.lexists(self.out)
        except OutputBusy as e:
            self._cleanup()
            raise UsageError(f"another run ({e}) is writing {self.shown}; wait for it or use another -o") from None
        except OSError as e:
            self._cleanup()
            raise UsageError(f"-o {self.shown}: cannot write next to it ({e.strerror}: {self.lock.path})") from None

    def __exit__(self, *exc: object) -> None:
        try:
            if not self.existed and os.stat(self.out, follow_symlinks=False).st_size == 0:
                os.unlink(self.out)  # made by this run, which wrote nothing into it (a full disk)
        except OSError:
            pass
        from polyaccel.asr.results_file import printable

        self.lock.release()
        if self.lock.left_behind:  # the results are written: a note, not a failure
            print(f"note: could not remove the lock file {printable(str(self.lock.path))} "
                  f"({self.lock.left_behind}); the next run takes it over", file=sys.stderr)
        self._cleanup()

    def _cleanup(self) -> None:
        for d in reversed(self.made):  # innermost first; a folder now holding the output stays
            try:
                os.rmdir(d)
            except OSError:
                break


def _make_parents(folder: str, shown: str) -> list[str]:
    """Create ``folder`` and missing parents; return those created, outermost first."""
    missing = []
    while folder and not os.path.lexists(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    if folder and not os.path.isdir(folder):
        raise UsageError(f"-o {shown}: {folder} is not a directory")
    made = []
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except OSError as e:
            for m in reversed(made):
                os.rmdir(m)
            raise UsageError(f"-o {shown}: cannot create {d} ({e.strerror})") from None
        made.append(d)
    return made


def _previous_results(out: str, shown: str) -> list[dict[str, Any]]:
    """The records already in ``out`` (none if it does not exist). A file that is not ours is
    refused, --overwrite or not; an output we could not write to is refused too."""
    from polyaccel.asr.results_file import NotResultsFile, scan_results

    if not os.path.exists(out):
        return []
    try:
        os.close(os.open(out, os.O_WRONLY | os.O_CLOEXEC))  # opening for writing changes nothing
        return scan_results(out).records
    except NotResultsFile as e:
        raise UsageError(f"-o {shown} exists and is not a polyaccel-asr results file ({e}); "
                         f"refusing to touch it: choose another -o or remove it") from None
    except OSError as e:
        raise UsageError(f"-o {shown}: {e.strerror}") from None


@dataclasses.dataclass(slots=True)
class _Counts:
    ok: int = 0
    failed: int = 0
    audio_s: float = 0.0
    stopped: str | None = None  # why the run ended early (a write error)
    held: list[dict[str, Any]] | None = None  # failed records not written: --overwrite kept the earlier file


def _run(todo: list[Any], args: argparse.Namespace, out: str, kept: list[dict[str, Any]], *,
         keep_earlier: bool = False) -> _Counts:
    """Transcribe ``todo`` and write its records to ``out``. The writer (which repairs, or with
    --overwrite truncates, the file) opens only when the first record is in hand, so a model or
    backend that fails to load leaves the file as it was; so does a resume whose ``kept`` records
    were made another way (another model, timestamps on or off, ...): a usage error.
    ``keep_earlier`` (--overwrite of a file with records): failed records are held until a file
    is transcribed, so a run in which every file fails leaves the earlier results (``held``)."""
    from polyaccel.asr.ray_job import ActorsFailed, RowsLost  # (no Ray needed to import it)
    from polyaccel.asr.results_file import ResultsWriter, path_key
    from polyaccel.core.runtime import ReplicaStartError

    c = _Counts()
    writer = bar = None
    held: list[dict[str, Any]] = []
    start = time.perf_counter()
    # Records are matched to inputs by path, never by position: after a row a Ray job lost,
    # the rows behind it still come back (ray_job.exactly_once_indexed), one place early.
    unwritten = {it.path: it for it in todo}
    retried = {path_key(it.path) for it in todo}  # failed records of other inputs stay in the file
    try:
        records = _results(todo, args)  # the model loads here (its errors: nothing written, no bar)
        bar = _progress(len(todo), args.quiet)  # from the first batch on, not from its result
        start = time.perf_counter()
        for rec in records:
            item = unwritten.pop(rec.get("path"), None)
            if item is None:
                raise RowsLost(f"a result came back for {rec.get('path')!r}, which is not an input of this "
                               "run, or came twice")
            rec = _finish(rec, item)
            if writer is None and keep_earlier and rec.get("error"):
                held.append(rec)
            else:
                if writer is None:
                    clash = _made_differently(kept, rec, args.timestamps)
                    if clash:
                        raise UsageError(_made_differently_message(args.output, clash))
                    writer = ResultsWriter(out, resume=not args.overwrite, retried=retried)
                    for earlier in held:
                        writer.write(earlier)
                writer.write(rec)
            if rec.get("error"):
                c.failed += 1
            else:
                c.ok += 1
                c.audio_s += rec.get("duration_s") or 0.0
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{c.audio_s / max(time.perf_counter() - start, 1e-9):.1f} audio-s/s")
    except OSError as e:
        c.stopped = f"cannot write {args.output}: {e.strerror or e}"
    except RowsLost as e:  # what came back is written; the rerun does the rest
        c.stopped = str(e)
    except ActorsFailed as e:  # the model does not load on the cluster: a usage error if nothing came back
        if writer is None:
            raise UsageError(str(e)) from None
        c.stopped = str(e)
    except ReplicaStartError as e:  # the model loaded but a replica of it does not start
        if writer is None:
            raise UsageError(_not_started(e)) from None
        c.stopped = _not_started(e)
    finally:
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.close()
        elif held:
            c.held = held
    return c


def _not_started(e: Exception) -> str:
    """What a replica that failed to start (``ReplicaStartError``) says, in one line."""
    cause = e.__cause__ or e
    return f"the model does not start: {type(cause).__name__}: {cause}"


def _usage_error(e: Exception) -> UsageError:
    """A model or backend error as a usage error (a KeyError's message without its quotes; a
    system error on a model file or the model cache: what and where)."""
    if isinstance(e, OSError) and e.strerror:
        return UsageError(f"cannot load the model: {e.strerror}" + (f": {e.filename}" if e.filename else ""))
    return UsageError(e.args[0] if isinstance(e, KeyError) and e.args else str(e))


def _check_made_alike(kept: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Raise the usage error a run would raise at its first record if ``kept`` was made another
    way, for a run with nothing left to transcribe (its model is named, not loaded: its dtype
    is compared only when --dtype names it)."""
    from polyaccel.asr.weights import model_provenance

    try:
        mine: dict[str, Any] = model_provenance(args.model)
    except (KeyError, ValueError, OSError) as e:
        raise _usage_error(e) from None
    if getattr(args, "fp8_encoder", False):
        mine["encoder_gemms"] = "fp8"
    if getattr(args, "batch_invariant", False):
        mine["batch_invariant"] = True
    if args.dtype:  # unset: the backend's, not known until the model loads, so not compared
        mine["dtype"] = args.dtype
    mine["overlap_s"] = args.overlap
    if getattr(args, "no_speech_threshold", None) is not None:
        mine["no_speech_threshold"] = args.no_speech_threshold
    clash = _made_differently(kept, mine, args.timestamps)
    if clash:
        raise UsageError(_made_differently_message(args.output, clash))


def _made_differently_message(output: str, clash: str) -> str:
    return (f"-o {output} holds results made another way ({clash}); resuming would mix them in one file, "
            "and its records are not what this command makes: use --overwrite to start it afresh, or another -o")


_SETTINGS = ("dtype", "overlap_s", "no_speech_threshold")  # settings that change the text, besides the model's


def _made_differently(kept: list[dict[str, Any]], first: dict[str, Any], timestamps: bool) -> str | None:
    """Why the records a resume keeps were not made as this run makes ``first`` (another model
    or weights, timestamps on or off, FP8 encoder GEMMs, batch invariance, dtype, window
    overlap, no-speech threshold), or None. A record from before records named their weights
    is taken to be this model's; one from before they named their dtype, or their overlap (and
    no-speech threshold), is taken to match in those; so is a dtype ``first`` does not name."""
    mine = _how_made(first, timestamps)
    for rec in kept:
        theirs = _how_made(rec, "segments" in rec)
        if "weights_sha256" not in rec:
            theirs.update(model=mine["model"], weights_sha256=mine["weights_sha256"])
        elif theirs["weights_sha256"] and theirs["weights_sha256"] == mine["weights_sha256"]:
            theirs["model"] = mine["model"]  # the same weights under another name (a moved folder)
        if "dtype" not in rec or "dtype" not in first:
            theirs["dtype"] = mine["dtype"]
        if "overlap_s" not in rec or "overlap_s" not in first:  # the threshold is written only when on
            theirs.update(overlap_s=mine["overlap_s"], no_speech_threshold=mine["no_speech_threshold"])
        if theirs != mine:
            differ = {k for k in _SETTINGS if theirs[k] != mine[k]}  # named only when they differ
            return f"{rec['path']}: {_describe(theirs, differ)}; this run: {_describe(mine, differ)}"
    return None


def _how_made(rec: dict[str, Any], timestamps: bool) -> dict[str, Any]:
    return {"model": rec.get("model"), "weights_sha256": rec.get("weights_sha256"), "timestamps": bool(timestamps),
            "encoder_gemms": rec.get("encoder_gemms"), "batch_invariant": bool(rec.get("batch_invariant")),
            "dtype": rec.get("dtype"), "overlap_s": _to_the_sample(rec.get("overlap_s")),
            "no_speech_threshold": rec.get("no_speech_threshold")}


def _to_the_sample(seconds: Any) -> Any:
    """Seconds rounded to a 16 kHz sample, what windows are cut at (3.0000001 is 3); anything
    else (a hand-edited line) as it is."""
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds):
        return round(seconds * 16000) / 16000
    return seconds


def _describe(how: dict[str, Any], settings: Collection[str] = ()) -> str:
    """The model, timestamps, FP8 and batch invariance ``how`` says, and those of ``settings`` (dtype, ...)."""
    sha = how["weights_sha256"]
    parts = [f"model {how['model']}" + (f" (weights {sha[:12]})" if isinstance(sha, str) else ""),
             "timestamps" if how["timestamps"] else "no timestamps"]
    parts += ["FP8 encoder GEMMs"] if how["encoder_gemms"] else []
    parts += ["batch-invariant"] if how["batch_invariant"] else []
    parts += [f"dtype {how['dtype']}" if how["dtype"] else "the backend's dtype"] if "dtype" in settings else []
    parts += [f"overlap {_seconds(how['overlap_s'])} s"] if "overlap_s" in settings else []
    if "no_speech_threshold" in settings:
        nst = how["no_speech_threshold"]
        parts.append(f"no-speech threshold {'off' if nst is None else _seconds(nst)}")
    return ", ".join(parts)


def _seconds(x: Any) -> str:
    """A number as typed (3, 0.5); anything else (a hand-edited line) as it is."""
    return f"{x:g}" if isinstance(x, (int, float)) and not isinstance(x, bool) else repr(x)


def _finish(rec: dict[str, Any], item: Any) -> dict[str, Any]:
    """The record as written: the input's own path (exact, whatever came back from Ray) and a
    clearer reason for a broken symlink."""
    rec["path"] = item.path
    if rec.get("error") == "missing file" and os.path.islink(item.path):
        rec["error"] = f"broken symbolic link (to {os.readlink(item.path)})"
    return rec


def _say(message: str) -> None:
    """A summary line on stderr; a stderr that cannot be written (a log on a full disk) loses the
    line, not the run's exit status (the results are in the file)."""
    try:
        print(message, file=sys.stderr)
    except OSError:
        pass


def _report(args: argparse.Namespace, c: _Counts, skipped: int, wall: float) -> int:
    """Print the summary (and failed files, and WER with references); return the exit status."""
    from polyaccel.asr.results_file import load_results, printable

    _say(f"{c.ok} ok, {c.failed} failed, {skipped} skipped; {c.audio_s:.1f} s of audio in {wall:.1f} s: "
         f"RTFx {c.audio_s / wall if wall > 0 else 0:.1f} (end to end, feature extraction included)")
    records = load_results(args.output) if c.held is None else c.held
    for rec in records if c.failed and not args.quiet else []:
        if rec.get("error"):
            _say(printable(f"  failed: {rec['path']}: {rec['error']}"))
    if c.held is not None:
        _say(f"{printable(args.output)} left as it was: no file was transcribed, and --overwrite replaces the earlier "
             "results only once a file is transcribed")
    with_refs = [r for r in records if r.get("ref") is not None and not r.get("error")]
    if with_refs:
        from polyaccel.asr.wer import wer_counts

        wc = wer_counts([r["ref"] for r in with_refs], [r["text"] for r in with_refs])
        _say(f"WER {100 * wc.wer:.2f}% over {len(with_refs)} files ({wc.ref_words} reference words)")
    if c.stopped:
        _say(f"stopped early: {printable(c.stopped)}; rerun the same command to resume")
        return EXIT_SOME_FAILED
    if c.failed and not c.ok and not skipped:
        _say(f"nothing was transcribed: {_files(c.failed)} failed, none done before")
        return EXIT_NOTHING_DONE
    if c.failed:
        _say(f"{_files(c.failed)} failed; rerun the same command to retry them")
        return EXIT_SOME_FAILED
    if not c.ok and not args.quiet:
        _say(f"nothing to do: all {_files(skipped)} are already in {printable(args.output)}")
    return EXIT_OK


def _files(n: int) -> str:
    return f"{n} file" if n == 1 else f"{n} files"


def _results(todo: list[Any], args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """Output records for ``todo`` in input order, from the local pool or a Ray job. Model,
    backend and Ray problems are raised here, before the first record is asked for."""
    if not todo:
        return iter(())
    if args.ray:
        from polyaccel.asr.ray_job import RayJobOptions, import_ray, transcribe_with_ray
        from polyaccel.core import backends
        from polyaccel.core.ray_local import check_address, starts_private_cluster

        for flag in ("fp8_encoder", "batch_invariant", "no_speech_threshold"):
            if getattr(args, flag, None) not in (None, False):
                raise UsageError(f"--{flag.replace('_', '-')} does not run with --ray yet: run without --ray")

        try:
            if not starts_private_cluster(args.address):
                check_address(args.address)
            import_ray()
        except (ImportError, ValueError) as e:
            raise UsageError(f"--address: {e}" if isinstance(e, ValueError) else str(e)) from None
        if args.backend != "auto" and args.backend not in backends():
            from polyaccel.core.plugins import unknown_backend_message

            raise UsageError(unknown_backend_message(args.backend, backends()))
        from polyaccel.asr.weights import resolve

        try:  # here, before a cluster starts: the actors read the inputs' paths here too
            resolve(args.model)
        except (KeyError, ValueError, OSError) as e:
            raise _usage_error(e) from None
        opts = RayJobOptions(model=args.model, backend=args.backend, replicas=args.replicas,
                             batch_size=args.batch_size, dtype=args.dtype, overlap_s=args.overlap,
                             address=args.address, num_actors=args.num_actors, timestamps=args.timestamps)
        return transcribe_with_ray(todo, opts)
    return _local_records(_transcriber(args), todo, args.model)


def _local_records(tr: Any, todo: list[Any], model: str) -> Iterator[dict[str, Any]]:
    from polyaccel.asr.wer import wer

    try:
        for r in tr.transcribe_iter(todo):
            extra: dict[str, Any] = {"model": tr.model_name or model, **tr.made_with(),
                                     "rtfx": round(tr.running_rtfx(), 2)}
            if r.ref is not None and r.ok:
                extra["wer"] = round(wer([r.ref], [r.text]), 4)
            yield r.to_record(**extra)
    finally:
        tr.close()


def _transcriber(args: argparse.Namespace, batch_size: int | None = None) -> Any:
    from polyaccel.asr.transcriber import Transcriber, WeightsReplaced
    from polyaccel.core import BackendUnavailable

    try:
        return Transcriber.from_pretrained(args.model, backend=args.backend, replicas=args.replicas,
                                           batch_size=batch_size or args.batch_size, dtype=_dtype(args.dtype),
                                           overlap_s=getattr(args, "overlap", 3.0),
                                           timestamps=getattr(args, "timestamps", False),
                                           fp8_encoder=getattr(args, "fp8_encoder", False),
                                           batch_invariant=getattr(args, "batch_invariant", False),
                                           no_speech_threshold=getattr(args, "no_speech_threshold", None))
    except (BackendUnavailable, KeyError, ValueError, OSError, ModuleNotFoundError,
            WeightsReplaced) as e:  # OSError: not the -o's
        raise _usage_error(e) from None
    except RuntimeError as e:
        if "can't start new thread" not in str(e):
            raise
        raise UsageError(f"cannot start a thread for each of the {args.replicas} replicas (the system's limit "
                         "on threads): ask for fewer with --replicas") from None


def _may_exist(spec: str) -> bool:
    """False only when nothing is at ``spec``; a path we may not look at (inside a folder we
    may not enter) may exist: it becomes a per-file error saying so, not "no such file"."""
    try:
        os.lstat(spec)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True
    return True


def _gather(specs: Sequence[str]) -> list[Any]:
    from polyaccel.asr.manifest import expand_inputs

    for spec in specs:
        if not spec:  # Path("") is the current folder: a "$UNSET" variable must not mean everything here
            raise UsageError("an input is an empty name (an unset shell variable?)")
        if spec.endswith(("/", os.sep)) and not os.path.isdir(spec):
            raise UsageError(f"no such directory: {spec}")
    if specs and not any(_may_exist(spec) for spec in specs):
        # Every input mistyped: nothing to do, nothing written (one missing file among others
        # is a per-file error instead, so the rest still run).
        raise UsageError(f"no such file or directory: {' '.join(specs)}")
    try:
        items = expand_inputs(specs)
    except (ValueError, json.JSONDecodeError) as e:
        raise UsageError(f"bad manifest: {e}") from None
    except OSError as e:  # a manifest (or folder) we may not read
        raise UsageError(f"cannot read {e.filename}: {e.strerror or e}") from None
    if not items:
        raise UsageError(f"no audio files found in {' '.join(specs)}")
    return items


def _refuse_descriptors(paths: Iterable[str]) -> None:
    """A usage error for standard input (``-``, ``/dev/stdin``) or another open descriptor as an
    input of ``transcribe``: its results would be resumed under that name, whatever it holds."""
    from polyaccel.asr.results_file import printable

    for path in paths:
        if (path == "-" and not os.path.lexists(path)) or _names_a_descriptor(path):
            raise UsageError(f"{printable(path)}: {_NO_STDIN}")


_NO_STDIN = ("audio is not read from standard input or another open descriptor (a rerun resumes by "
             "file name, and would take other audio there for done): save it to a file and name the file")


def _names_a_descriptor(path: str) -> bool:
    """Whether ``path`` is standard input or another of a process's open descriptors
    (``/dev/stdin``, ``/dev/fd/3``, ``/proc/self/fd/0``, a shell's ``<(...)``)."""
    import re

    from polyaccel.asr.results_file import path_key

    key = path_key(path)
    return key in ("/dev/stdin", "/dev/stdout", "/dev/stderr") or bool(re.match(r"/dev/fd/|/proc/[^/]+/(task/[^/]+/)?fd/", key))


_NOT_REGULAR = "is not a regular file (a device, pipe or socket); give a file"


def _read_refs(path: str, read_refs: Any) -> dict[str, str]:
    if not path:
        raise UsageError("--refs is an empty name (an unset shell variable?)")
    if not Path(path).is_file():
        what = ("is a folder, not a reference file (JSONL or '<s> text </s> (id)' lines)" if Path(path).is_dir()
                else _NOT_REGULAR if os.path.exists(path) else "not found")
        raise UsageError(f"--refs {path}: {what}")
    try:
        return read_refs(path)
    except (ValueError, json.JSONDecodeError) as e:
        raise UsageError(f"bad reference file: {e}") from None
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None


def _dtype(name: str | None) -> Any:
    if name is None:
        return None
    import torch

    return getattr(torch, name)


def _progress(total: int, quiet: bool) -> Any:
    if quiet or total == 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="file", file=_BarStream(sys.stderr), dynamic_ncols=True)


class _BarStream:
    """stderr for the progress bar: a write error there (a log on a full disk) turns the bar off
    instead of stopping the run, where it read as the results file's error."""

    def __init__(self, stream: Any):
        self.stream, self.broken = stream, False

    def write(self, text: str) -> int:
        try:
            return 0 if self.broken else self.stream.write(text)
        except OSError:
            self.broken = True
            return 0

    def flush(self) -> None:
        try:
            if not self.broken:
                self.stream.flush()
        except OSError:
            self.broken = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


# ---- wer ------------------------------------------------------------------------------------------


def cmd_wer(args: argparse.Namespace) -> int:
    """Print the corpus WER of a results file against references (as one JSON line)."""
    from polyaccel.asr.manifest import read_refs, ref_finder
    from polyaccel.asr.results_file import one_per_input, record_file
    from polyaccel.asr.wer import wer, wer_counts

    refs = _read_refs(args.refs, read_refs)
    find_ref = ref_finder(refs)
    hyps = _read_hyps(args.hyps)
    if os.path.samefile(args.refs, args.hyps):  # a results file reads as references too: WER 0
        raise UsageError(f"--refs and --hyps are the same file ({args.hyps}); give the reference texts as --refs")
    pairs, missing, failed = [], 0, 0
    for rec in one_per_input(hyps):  # an input listed twice counts once, as in export
        ref = refs.get(rec["path"])  # as written; else the file it names from its run's folder
        ref = find_ref(record_file(rec)) if ref is None else ref
        if ref is None:
            missing += 1
        elif rec.get("error"):
            failed += 1
        else:
            hyp = rec.get("text") if isinstance(rec.get("text"), str) else ""
            pairs.append((rec["path"], ref, hyp))
            if args.per_file:
                _emit({"path": rec["path"], "wer": round(wer([ref], [hyp]), 4), "ref": ref, "hyp": hyp})
    if not pairs:
        why = f"the {_files(failed)} matching them failed" if failed else "no results match the references"
        raise UsageError(f"{why} (matched by path or file stem); nothing to score")
    c = wer_counts([p[1] for p in pairs], [p[2] for p in pairs])
    _emit({"wer": round(c.wer, 5), "files": len(pairs), "ref_words": c.ref_words,
           "substitutions": c.substitutions, "deletions": c.deletions, "insertions": c.insertions,
           "failed": failed, "without_ref": missing})
    return 0


def _read_hyps(path: str) -> list[dict[str, Any]]:
    """The records of a results file; anything else (a reference file or manifest given by
    mistake would score itself: WER 0) is a usage error."""
    from polyaccel.asr.results_file import NotResultsFile, scan_results

    if not Path(path).is_file():
        if os.path.exists(path):
            raise UsageError(f"--hyps {path}: {'is a folder' if Path(path).is_dir() else _NOT_REGULAR}")
        raise UsageError(f"results file not found: {path}")
    try:
        return scan_results(path).records
    except NotResultsFile as e:
        raise UsageError(f"--hyps {path} is not a polyaccel-asr results file ({e})") from None
    except OSError as e:
        raise UsageError(f"--hyps {path}: {e.strerror or e}") from None


# ---- bench -----------------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    """RTFx of the whole pipeline (audio already in memory) at each batch size; JSON lines."""
    from polyaccel.asr.audio import AudioError, load_audio
    from polyaccel.asr.results_file import printable

    if args.batch_size is not None:
        raise UsageError("bench runs each of --batch-sizes (a comma-separated list); --batch-size would be ignored")
    try:
        sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"--batch-sizes must be integers, got {args.batch_sizes!r}") from None
    if not sizes or min(sizes) < 1:
        raise UsageError(f"--batch-sizes must be integers >= 1, got {args.batch_sizes!r}")
    audio = []
    for it in _gather(args.inputs):
        try:
            audio.append(load_audio(it.path))
        except AudioError as e:
            print(printable(f"skipping {it.path}: {e}"), file=sys.stderr)
    if not audio:
        raise UsageError("no readable audio")
    audio = audio * max(1, args.repeat)
    for bs in sizes:
        tr = _transcriber(args, batch_size=bs)
        try:
            tr.transcribe(audio[: max(bs * tr.replicas, 1)])  # warm-up: graphs, caches, allocator
            results = tr.transcribe(audio)
            m = tr.last_metrics
            _emit({"model": args.model, "backend": tr.backend_name, "replicas": tr.replicas,
                   "batch_size": bs, **m.as_dict(), "errors": sum(not r.ok for r in results)})
        finally:
            tr.close()
    return 0


# ---- compile -----------------------------------------------------------------------------------------


def cmd_compile(args: argparse.Namespace) -> int:
    """Compile every (graph, bucket) of the model for the backend, so serving starts warm."""
    from polyaccel.core import BackendUnavailable, select_backend

    try:
        be = select_backend(args.backend)
    except (BackendUnavailable, KeyError) as e:
        raise UsageError(str(e).strip("'\"")) from None
    tr = _transcriber(args)  # the model loads (or the usage error transcribe would give), on every backend
    if be.device_type == "cpu":
        tr.close()
        print(f"backend {be.name!r} runs eagerly: nothing to compile ahead of time", file=sys.stderr)
        return 0
    start = time.perf_counter()
    try:
        compiled = tr.compile_all()
    finally:
        tr.close()
    _emit({"backend": be.name, "model": args.model, "graphs": compiled,
           "seconds": round(time.perf_counter() - start, 2)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
