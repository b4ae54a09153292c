"""``overlapc dump | report | timeline | calibrate | demo``: capture, schedule and explain a model's graphs.

TARGET is ``path/to/file.py:function`` or ``module:function``. The function
takes no arguments and returns ``(model, example_inputs)``; it runs after the
CLI has initialised a fake process group (backend "fake": no network, any
world size) of ``--world-size`` ranks as ``--rank``, so it may build device
meshes and shard the model (``overlapc.fsdp.shard``). The CLI then captures one
forward and backward and works on the scheduled graphs ("fw_0", "bw_0", ...;
``--graph fw|bw|all`` selects). ``--dispatch auto|cuda|cpu`` says how: cuda
captures the graphs as the CUDA compile makes them (``overlapc.cuda_capture``: a
fake H100's attention dispatch, e.g. efficient attention, and Inductor's
min-cut partitioner; needs the triton package, else the CLI says so
and exits 2), cpu as ``overlapc.backend.capture`` does on CPU (CPU dispatch, the
default partitioner); auto (default) takes cuda for a GPU profile and cpu for a
CPU one. Every output says which it used ("dispatch: ..."). The
schedule's options are ``--max-in-flight K|none``,
``--max-in-flight-bytes B|auto|serial-peak|none`` (B may end in KiB, MiB or
GiB), ``--bucket auto|module|B|none``, ``--chunks N|auto`` and
``--regather always|auto``. The estimates
use ``--profile NAME|FILE`` (a built-in "device:link" name or a file written
by ``overlapc calibrate``), else ``--device``/``--link`` (default h100 and
nvlink: a plan for that machine, not a measurement of this one), with any of
``--tflops --mem-gbps --link-gbps --latency-us`` replacing the profile's own
numbers (``overlapc.costmodel.profile``); ``--profile`` beats
``--device``/``--link``. Every report names the profile it used and where it
came from.

    overlapc dump TARGET --world-size N [--out DIR]
        DIR/<graph>/before.txt, after.txt, report.txt, report.json
        (``overlapc.report.write_artifacts``; report.json is "overlapc.report/1",
        with the "dispatch" entry).
    overlapc report TARGET --world-size N [--format text|json] [--wide] [--quiet]
                    [--html FILE [--trace TRACE]]
        A summary per graph and one row per collective, on stdout: compact
        rows within 120 columns (``overlapc.report.format_graph``), every
        column with ``--wide``, the summaries only with ``--quiet``. ``--html``
        also writes one self-contained page (``overlapc.html_report``): per
        graph, the simulated timelines before and after, live bytes of both
        orders and the collectives; with ``--trace`` (a torch.profiler trace
        of these graphs) the measured run beside the estimate.
    overlapc timeline TARGET --world-size N [-o trace.json]
        The simulated schedule before and after, as a Chrome / Perfetto trace.
    overlapc calibrate [--world-size N] [-o profile.json] [--quick]
        Measure this machine (``overlapc.calibrate``): collectives on N local
        gloo ranks on 127.0.0.1 (N >= 2; spawned here), or on the ranks of a
        torchrun launch (RANK/WORLD_SIZE/MASTER_ADDR in the environment: every
        rank runs the command, rank 0 writes), or compute only (N = 1, the
        default without torchrun; ``--link`` names the built-in link to
        record). Writes the profile file ("overlapc.profile/1").
    overlapc demo [ARGS...]
        ``overlapc.demo.main(ARGS)``.

The backward starts where ``overlapc.backend.backward_root`` says (the
output's ``loss``, else the sum of its floating outputs); a progress line says
from what, or why there is none.

Output is deterministic: same target and flags, same bytes. Progress goes to
stderr (``--quiet`` silences it). Bad input (missing file or function, a
target that does not import: a syntax or import error, with its file:line, a
function that does not return ``(model, inputs)``, world size < 1, rank
outside [0, N), an output path that cannot be written, a bad flag value: the
message lists the accepted forms, with "did you mean" for a misspelt word)
prints one line on stderr and exits 2; any other exception raised inside the
target's own code propagates with its traceback. If a default process group already exists
(the CLI called in-process), it is used when its world size and rank match
and left as it is; otherwise the CLI's fake group is destroyed on return.

``overlapc report --format json`` schema ("overlapc.cli.report/1")::

    {"schema": "overlapc.cli.report/1",
     "target": "examples/mlp.py:build", "world_size": 8, "rank": 0,
     "config": {"max_in_flight": 2 | null, "max_in_flight_bytes": int | "auto" | "serial-peak" | null,
                "bucket": "auto" | "module" | int | null, "chunks": int | "auto",
                "regather": "always" | "auto", "narrow_gathers": bool, "enabled": bool},
     "profile": {"device": {"name", "tflops", "mem_gbps"},
                 "link": {"name", "gbps", "latency_us", "per_kind": [[kind, gbps, latency_us], ...]},
                 "name": "h100:nvlink" | profile file path, "source": where the numbers came from},
     "dispatch": {"device": "cuda" | "cpu", "attention": ["efficient", ...], "partitioner": "min-cut" | "default",
                  "described": "cuda (fake H100, efficient attention, min-cut partitioner)" | "cpu"},
     "graphs": [{"name": "fw_0",
                 "rows": [<overlapc.report.Row fields>, ...],   # issue order after
                 "summary": {<overlapc.report.summary keys>}}, ...]}

``overlapc timeline`` trace (Chrome trace event format, JSON object form)::

    {"traceEvents": [...], "displayTimeUnit": "ms",
     "otherData": {"schema": "overlapc.cli.timeline/1", "target", "world_size",
                   "rank", "config", "profile", "dispatch"}}

Per graph (i = 0, 1, ... in capture order) two processes: pid 2i+1 named
"<graph> before" and pid 2i+2 named "<graph> after" (metadata events "M":
process_name, process_sort_index, thread_name). Thread 0 is "compute"; thread
k >= 1 is "comm group <name>", one per process group, in sorted group order.
Complete events (ph "X", ts and dur in microseconds from the graph's start):
cat "compute" for each node that costs time, cat "comm" for each collective
(on its group's thread, from when it starts running to when it ends), cat
"exposed" for the time compute stalls on a collective's wait (on thread 0).
Names are the op plus the module path where known; args hold the node name.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import importlib
import importlib.util
import json
import os
import re
import sys
import tempfile
import textwrap
import traceback

REPORT_SCHEMA = "overlapc.cli.report/1"
TIMELINE_SCHEMA = "overlapc.cli.timeline/1"


class UsageError(Exception):
    """Bad input: main() prints it as one line on stderr and returns 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


_SIZE = re.compile(r"\s*(\d+)\s*(|KiB|MiB|GiB)\s*")
_UNITS = {"": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _word(text: str, words: tuple[str, ...], forms: str) -> str | None:
    """``text`` lower-cased when it is one of ``words``; else None, or an error with
    "did you mean" when it is close to one of them (a misspelt word, not a number)."""
    word = text.strip().lower()
    if word in words:
        return word
    close = difflib.get_close_matches(word, words, n=1, cutoff=0.5)
    if close:
        raise argparse.ArgumentTypeError(f"expected {forms}, got {text!r}; did you mean {close[0]!r}?")
    return None


def _count(text: str) -> int | None:
    """--max-in-flight: 'none' -> None; '8' -> 8 (a count: no size suffix)."""
    forms = "an int >= 1 (a count, no KiB/MiB/GiB suffix) or 'none'"
    if _word(text, ("none",), forms) == "none":
        return None
    if not re.fullmatch(r"\s*\d+\s*", text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected {forms}, got {text!r}")
    return int(text)


def _byte_limit(words: tuple[str, ...]):
    """A flag type: one of ``words``, or bytes >= 1 ('65536', '64KiB', '1GiB')."""
    forms = ", ".join(repr(w) for w in words) + " or a byte size >= 1 (e.g. 65536, 64KiB, 16MiB, 1GiB)"

    def parse(text: str) -> int | str | None:
        word = _word(text, words, forms)
        if word is not None:
            return None if word == "none" else word
        match = _SIZE.fullmatch(text)
        if not match or int(match.group(1)) < 1:
            raise argparse.ArgumentTypeError(f"expected {forms}, got {text!r}")
        return int(match.group(1)) * _UNITS[match.group(2)]
    return parse


def _regather(text: str) -> str:
    """--regather: 'always' or 'auto' (OverlapConfig.regather)."""
    forms = "'always' or 'auto'"
    word = _word(text, ("always", "auto"), forms)
    if word is None:
        raise argparse.ArgumentTypeError(f"expected {forms}, got {text!r}")
    return word


def _chunks(text: str) -> int | str:
    """--chunks: an int >= 1 (1 = off) or 'auto'."""
    forms = "an int >= 1 (1 = off) or 'auto'"
    if _word(text, ("auto",), forms) == "auto":
        return "auto"
    if not re.fullmatch(r"\s*\d+\s*", text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected {forms}, got {text!r}")
    return int(text)


_EXAMPLES = {
    None: """examples:
  overlapc report examples/llama.py:build --world-size 8
  overlapc report examples/mlp.py:build --world-size 8 --profile cpu:ethernet --wide
  overlapc dump examples/llama.py:build --world-size 8 --out llama-dump
  overlapc calibrate --world-size 2 -o profile.json
  overlapc demo

`overlapc COMMAND --help` describes a command and its options.""",
    "dump": """examples:
  overlapc dump examples/llama.py:build --world-size 8 --out llama-dump
  overlapc dump examples/mlp.py:build --world-size 8 --graph fw --bucket none""",
    "report": """examples:
  overlapc report examples/llama.py:build --world-size 8
  overlapc report examples/mlp.py:build --world-size 8 --profile cpu:ethernet --wide
  overlapc report examples/llama.py:build --world-size 8 --dispatch cpu --html schedule.html""",
    "timeline": """examples:
  overlapc timeline examples/llama.py:build --world-size 8 -o llama-trace.json
  overlapc timeline examples/mlp.py:build --world-size 8 --max-in-flight none""",
    "calibrate": """examples:
  overlapc calibrate --world-size 2 -o profile.json
  overlapc calibrate --quick
  torchrun --nproc-per-node 8 -m overlapc.cli calibrate -o profile.json""",
    "analyze": """examples:
  overlapc analyze trace_rank0.json --dump DIR
  overlapc analyze trace_rank0.json --dump DIR --profile profile.json --timeline measured.json""",
}


def _command(commands, name: str, purpose: str, **kwargs) -> argparse.ArgumentParser:
    """A subcommand whose --help starts with its one-line ``purpose`` and ends with its examples."""
    return commands.add_parser(name, help=purpose, description=textwrap.fill(purpose, 100),
                               epilog=_EXAMPLES.get(name), formatter_class=argparse.RawDescriptionHelpFormatter,
                               **kwargs)


def _common_options() -> argparse.ArgumentParser:
    """The options dump, report and timeline share: the target, the fake world, the
    scheduling knobs (OverlapConfig's) and the estimates' profile."""
    from overlapc import costmodel

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("target", help="path/to/file.py:function or module:function; the function takes no "
                        "arguments and returns (model, example_inputs)")
    common.add_argument("--world-size", type=int, required=True, metavar="N",
                        help="ranks of the fake process group the target is built under (required)")
    common.add_argument("--rank", type=int, default=0, metavar="R", help="this process's rank (default 0)")
    common.add_argument("--graph", choices=("fw", "bw", "all"), default="all",
                        help="which graphs: forward, backward or all (default all)")
    common.add_argument("--max-in-flight", type=_count, default=argparse.SUPPRESS, metavar="K|none",
                        help="collectives of one group and kind in flight, at most (default 3, OverlapConfig's)")
    common.add_argument("--max-in-flight-bytes", type=_byte_limit(("auto", "serial-peak", "none")),
                        default=argparse.SUPPRESS, metavar="B|auto|serial-peak|none",
                        help="bytes held in flight per group, at most, e.g. 64MiB (default serial-peak: only "
                        "what fits under the serial order's peak, so the peak never rises; auto: twice the "
                        "group's largest collective, more where memory allows, which may raise the peak)")
    common.add_argument("--regather", type=_regather, default=argparse.SUPPRESS, metavar="always|auto",
                        help="joint forward+backward graphs: re-gather every parameter in the backward "
                        "(always, the default) or keep a block's forward gathers where the peak allows (auto)")
    common.add_argument("--no-narrow-gathers", dest="narrow_gathers", action="store_false",
                        default=argparse.SUPPRESS,
                        help="gather as traced: no cast of the shard before an all-gather whose result is only "
                        "cast narrower (float8 weights; the default casts first and gathers the narrow bytes)")
    common.add_argument("--bucket", type=_byte_limit(("auto", "module", "none")), default=argparse.SUPPRESS,
                        metavar="auto|module|B|none",
                        help="merge collectives: up to the largest one (auto, the default), "
                        "one bucket per block, a byte target, or none")
    common.add_argument("--chunks", type=_chunks, default=argparse.SUPPRESS, metavar="N|auto",
                        help="split critical-path collectives into N pipelined pieces, or auto: per "
                        "pattern, the count the estimates put fastest (default 1: off)")
    common.add_argument("--profile", metavar="NAME|FILE", help="the estimates' numbers: a built-in "
                        "'device:link' (e.g. cpu:ethernet) or a file written by `overlapc calibrate`; "
                        "beats --device/--link (default: --device and --link)")
    common.add_argument("--device", choices=sorted(costmodel.DEVICES),
                        help="built-in device whose FLOP rate and memory bandwidth the estimates assume "
                        "(default h100: a plan for that GPU, not a measurement of this machine)")
    common.add_argument("--link", metavar="LINK", help=f"built-in link the collectives use: "
                        f"{'|'.join(costmodel.LINKS)}, or one per mesh dim or group: "
                        "shard=nvlink,replicate=ib (default nvlink)")
    common.add_argument("--tflops", type=float, help="device FLOP rate in TFLOP/s (default: the profile's)")
    common.add_argument("--mem-gbps", type=float, help="device memory bandwidth in GB/s (default: the profile's)")
    common.add_argument("--link-gbps", type=float, help="link bus bandwidth in GB/s, every kind "
                        "(default: the profile's)")
    common.add_argument("--latency-us", type=float, help="latency per collective in us, every kind "
                        "(default: the profile's)")
    common.add_argument("--dispatch", choices=("auto", "cuda", "cpu"), default="auto",
                        help="capture the graphs as the CUDA compile makes them (cuda: a fake H100's "
                        "attention dispatch (efficient/flash attention), Inductor's min-cut "
                        "partitioner; needs the triton package) or as CPU does (cpu); auto: cuda for a GPU "
                        "profile, cpu for a CPU one (default auto)")
    common.add_argument("--quiet", action="store_true", help="no progress lines on stderr; report: print "
                        "the header and each graph's summary only, no rows (default: off)")
    return common


def _parser() -> argparse.ArgumentParser:
    from overlapc import costmodel

    common = _common_options()
    parser = _Parser(prog="overlapc", description=textwrap.fill(
                     "Capture, schedule and explain the communication of a model's training graphs: which "
                     "collectives overlapc moves, where to, and what the estimates say they hide.", 100),
                     epilog=_EXAMPLES[None],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    dump = _command(commands, "dump", "write each graph's code before and after scheduling and its report "
                    "into files (DIR/<graph>/before.txt, after.txt, report.txt, report.json)", parents=[common])
    dump.add_argument("--out", default="overlapc-dump", metavar="DIR",
                      help="folder to write, created if needed (default overlapc-dump)")
    report = _command(commands, "report", "print, per graph, a summary and one row per collective: where "
                      "it moved, its estimated exposed time before -> after, and why", parents=[common])
    report.add_argument("--format", choices=("text", "json"), default="text",
                        help="text: the summary and table for people; json: the document "
                        f"{REPORT_SCHEMA!r} for programs (default text)")
    report.add_argument("--wide", action="store_true", help="text: every column (dtype, wait positions, "
                        "compute between, comm time, recorded reasons), lines as wide as they need "
                        "(default: compact rows within 120 columns)")
    report.add_argument("--html", metavar="FILE", help="also write the schedule as one self-contained HTML page: "
                        "simulated timelines before and after, live bytes, the collectives (default: none)")
    report.add_argument("--trace", metavar="FILE", help="with --html: a torch.profiler trace of these graphs "
                        "(what `overlapc analyze` reads), its measured run drawn beside the estimate (default: none)")
    timeline = _command(commands, "timeline", "write the simulated schedule before and after as a "
                        "Chrome/Perfetto trace file", parents=[common])
    timeline.add_argument("-o", "--out", default="overlapc-trace.json", metavar="FILE",
                          help="trace file to write (default overlapc-trace.json)")
    calibrate = _command(commands, "calibrate", "measure collectives and compute on this machine and write "
                         "a profile file for the estimates")
    calibrate.add_argument("--world-size", type=int, metavar="N", help="local gloo ranks to spawn (>= 2 measures "
                           "collectives; 1 = compute only; default: torchrun's WORLD_SIZE, else 1)")
    calibrate.add_argument("-o", "--out", default="overlapc-profile.json", metavar="FILE",
                           help="profile file to write (default overlapc-profile.json)")
    calibrate.add_argument("--quick", action="store_true", help="a short sweep: 3 sizes, 5 runs each "
                           "(default: the full sweep)")
    calibrate.add_argument("--link", choices=sorted(costmodel.LINKS), default="ethernet",
                           help="built-in link recorded when no collective is measured (default ethernet)")
    calibrate.add_argument("--timeout", type=float, default=600.0, metavar="S",
                           help="give up (and kill the spawned ranks) after S seconds (default 600)")
    calibrate.add_argument("--quiet", action="store_true", help="no progress lines on stderr (default: shown)")
    commands.add_parser("demo", help="train a small sharded transformer on 2 local gloo ranks under overlapc "
                        "and Inductor and compare them (`overlapc demo --help`)", add_help=False)
    from overlapc import analyze
    measured = _command(commands, "analyze", "measured exposed communication per collective in a "
                        "torch.profiler trace, beside overlapc's estimates")
    analyze.add_arguments(measured)
    _with_defaults(measured, {"dump": "default: none, measured numbers only",
                              "profile": "default: the dump's own estimates",
                              "format": "text for people or json for programs; default text",
                              "timeline": "default: none"})
    return parser


def _with_defaults(parser: argparse.ArgumentParser, defaults: dict[str, str]) -> None:
    """Each option's help ends with what it does by default (``overlapc.analyze``'s own
    flags say what they do, not their defaults)."""
    for action in parser._actions:
        if action.dest in defaults and "default" not in (action.help or ""):
            action.help = f"{action.help} ({defaults[action.dest]})" if action.help else defaults[action.dest]


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit code (0 ok, 2 bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        return _demo(argv[1:])
    try:
        args = _parser().parse_args(argv)
        return _run(args)
    except UsageError as error:
        command = next((a for a in argv if a in ("dump", "report", "timeline", "calibrate", "analyze")), "")
        message = " ".join(str(error).split())
        print(f"overlapc{' ' + command if command else ''}: error: {message}", file=sys.stderr)
        return 2
    except SystemExit as exit_:   # --help
        return exit_.code if isinstance(exit_.code, int) else 0


def _demo(argv: list[str]) -> int:
    try:
        from overlapc import demo
    except ModuleNotFoundError as error:
        if error.name not in ("overlapc.demo",):
            raise
        print("overlapc demo: error: overlapc.demo is not installed", file=sys.stderr)
        return 2
    return int(demo.main(argv) or 0)


def estimates(args: argparse.Namespace):
    """The Profile the flags ask for: --profile beats --device/--link; explicit numbers beat both."""
    from overlapc import costmodel

    numbers = dict(tflops=args.tflops, mem_gbps=args.mem_gbps, link_gbps=args.link_gbps,
                   latency_us=args.latency_us)
    if args.profile is not None:
        if all(v is None for v in numbers.values()):
            return costmodel.resolve(args.profile)
        return costmodel.profile(args.profile, **numbers)
    if args.device is None and args.link is None and all(v is None for v in numbers.values()):
        return costmodel.resolve(None)
    return costmodel.profile(args.device or "h100", args.link or "nvlink", **numbers)


def _calibrate(args: argparse.Namespace) -> int:
    from overlapc import calibrate

    env_world = os.environ.get("WORLD_SIZE")
    torchrun = env_world is not None and os.environ.get("MASTER_ADDR") is not None and "RANK" in os.environ
    world_size = args.world_size if args.world_size is not None else (int(env_world) if torchrun else 1)
    if world_size < 1:
        raise UsageError(f"world size must be >= 1, got {world_size}")
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be > 0, got {args.timeout}")
    if os.path.isdir(args.out):
        raise UsageError(f"{args.out} is a folder; -o takes a file name")
    _check_writable(os.path.dirname(os.path.abspath(args.out)))

    def say(message: str) -> None:
        if not args.quiet:
            print(f"overlapc calibrate: {message}", file=sys.stderr, flush=True)

    if torchrun and world_size == int(env_world):
        import torch
        import torch.distributed as dist

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
        try:
            calibrate.run_in_group(args.out, args.quick, args.link,
                                   say if dist.get_rank() == 0 else (lambda message: None))
            rank = dist.get_rank()
        finally:
            dist.destroy_process_group()
        if rank == 0:
            say(f"wrote {args.out}")
        return 0
    say(f"measuring {'collectives on ' + str(world_size) + ' local gloo ranks and ' if world_size > 1 else ''}"
        f"compute{' (quick sweep)' if args.quick else ''} ...")
    try:
        calibrate.run_local(world_size, args.out, args.quick, args.timeout, args.link, verbose=False)
    except RuntimeError as error:
        raise UsageError(str(error).splitlines()[0]) from error
    say(f"wrote {args.out}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from overlapc import cuda_capture
    from overlapc.collectives import collectives
    from overlapc.config import OverlapConfig

    if args.command == "calibrate":
        return _calibrate(args)
    if args.command == "analyze":
        from overlapc import analyze
        return analyze.run(args)
    if args.world_size < 1:
        raise UsageError(f"world size must be >= 1, got {args.world_size}")
    if not 0 <= args.rank < args.world_size:
        raise UsageError(f"rank {args.rank} is not in [0, {args.world_size})")
    options = {k: getattr(args, k) for k in ("max_in_flight", "max_in_flight_bytes", "bucket", "chunks",
                                             "regather", "narrow_gathers") if hasattr(args, k)}
    try:
        cfg = OverlapConfig.from_options(options)
        profile = estimates(args)
    except ValueError as error:
        raise UsageError(str(error)) from None
    device = cuda_capture.dispatch_for(profile, args.dispatch)
    if device == "cuda":
        _require_cuda_capture()
    if args.command == "dump":
        _check_writable(args.out)
    elif args.command == "report" and (args.html or args.trace):
        if not args.html:
            raise UsageError("--trace draws a measured run on the HTML page: give --html FILE as well")
        if os.path.isdir(args.html):
            raise UsageError(f"{args.html} is a folder; --html takes a file name")
        _check_writable(os.path.dirname(os.path.abspath(args.html)))
    elif args.command == "timeline":
        if os.path.isdir(args.out):
            raise UsageError(f"{args.out} is a folder; -o takes a file name")
        _check_writable(os.path.dirname(os.path.abspath(args.out)))
    build = _load(args.target)

    def say(message: str) -> None:
        if not args.quiet:
            print(message, file=sys.stderr, flush=True)

    if args.profile is not None and (args.device or args.link):
        say(f"using --profile {args.profile}; --device/--link ignored")
    if args.profile is not None:
        options["profile"] = args.profile   # the backend's own log lines use it too

    with _process_group(args.world_size, args.rank):
        built = build()
        if not (isinstance(built, (tuple, list)) and len(built) == 2 and callable(built[0])):
            raise UsageError(f"{args.target} must return (model, example_inputs), got {_describe(built)}")
        say(f"capturing forward/backward of {args.target} at world size {args.world_size} "
            f"(rank {args.rank}) ...")
        notes: list[str] = []
        records, dispatch = _capture(built, options, device, notes)
        say(notes[0])
        say(f"dispatch: {dispatch.describe()}")
        for record in records:
            say(f"scheduled {record.name}: {len(collectives(record.gm))} collectives")
        records = [r for r in records if args.graph == "all" or r.name.startswith(args.graph + "_")]
        if not records:
            why = f" ({notes[0]})" if args.graph == "bw" and notes[0].startswith("no backward") else ""
            raise UsageError(f"{args.target} produced no {'' if args.graph == 'all' else args.graph + ' '}"
                             f"graph{why}")
        header = {"target": args.target, "world_size": args.world_size, "rank": args.rank,
                  "config": {k: getattr(cfg, k) for k in ("max_in_flight", "max_in_flight_bytes", "bucket",
                                                          "chunks", "regather", "narrow_gathers", "enabled")},
                  "profile": dataclasses.asdict(profile), "dispatch": dispatch.as_dict()}
        if args.command == "dump":
            _dump(records, args.out, profile, say, header["dispatch"])
        elif args.command == "report":
            sys.stdout.write(_report(records, header, profile, args.format, args.wide, args.quiet))
            if args.html:
                _write_html(args, records, header, profile, cfg)
                say(f"wrote {args.html}")
        else:
            _write(args.out, _trace(records, header, profile))
            say(f"wrote {args.out} (open in https://ui.perfetto.dev or chrome://tracing)")
    return 0


def _require_cuda_capture() -> None:
    """UsageError, naming what to install or pass, when the CUDA-shaped capture cannot run."""
    from overlapc import cuda_capture
    try:
        cuda_capture.require_triton()
    except cuda_capture.CaptureUnavailable as error:
        raise UsageError(str(error)) from None


def _capture(built, options: dict, device: str, notes: list[str]):
    """(records, dispatch): one training step of ``built`` = (model, inputs) captured as
    ``device`` ("cuda" | "cpu", ``overlapc.cuda_capture.capture_as``) and scheduled."""
    from overlapc import cuda_capture
    try:
        return cuda_capture.capture_as(device, built[0], built[1], options, note=notes.append)
    except cuda_capture.CaptureUnavailable as error:
        raise UsageError(str(error)) from None


def _check_writable(folder: str) -> None:
    """Create ``folder`` if needed and write a probe file there (UsageError when that fails)."""
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as error:
        raise UsageError(f"cannot write to {folder}: {error.strerror or error}") from None


def _load(target: str):
    """The function named by ``path/to/file.py:function`` or ``module:function``."""
    where, _, name = target.rpartition(":")
    if not where or not name:
        raise UsageError(f"target must be path/to/file.py:function or module:function, got {target!r}")
    if where.endswith(".py") or "/" in where or os.sep in where:
        if not os.path.isfile(where):
            raise UsageError(f"no such file: {where}")
        module_name = "overlapc_target_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(where))[0])
        spec = importlib.util.spec_from_file_location(module_name, where)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module   # dataclasses and pickling look modules up here
        with _import_errors(where):
            spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:   # as `python -m` does; the console script does not
            sys.path.insert(0, os.getcwd())
        try:
            with _import_errors(where):
                module = importlib.import_module(where)
        except ModuleNotFoundError as error:
            if error.name is None or not (where == error.name or where.startswith(error.name + ".")):
                raise
            raise UsageError(f"no module named {error.name}") from None
    function = getattr(module, name, None)
    if not callable(function):
        found = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        close = difflib.get_close_matches(name, found, n=1)
        raise UsageError(f"{where} has no function {name!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
    return function


@contextlib.contextmanager
def _import_errors(where: str):
    """A SyntaxError or ImportError while importing the target becomes one UsageError
    line with the file:line it happened at (a missing target module itself passes)."""
    try:
        yield
    except SyntaxError as error:
        raise UsageError(f"{where} does not import: {error.filename}:{error.lineno}: "
                         f"SyntaxError: {error.msg}") from None
    except ImportError as error:
        if isinstance(error, ModuleNotFoundError) and error.name is not None and \
                (where == error.name or where.startswith(error.name + ".")):
            raise   # the target module itself is missing: _load says so
        frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith("<frozen")]
        at = f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""
        raise UsageError(f"{where} does not import: {at}{type(error).__name__}: {error}") from None


def _describe(value) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}: ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__


def _write_html(args: argparse.Namespace, records, header: dict, profile, cfg) -> None:
    """``report --html``: the records' schedule page (``overlapc.html_report``)."""
    from overlapc import html_report

    settings = ", ".join(f"{k}={v}" for k, v in header["config"].items())
    try:
        html_report.write_html(args.html, records, profile, cfg, trace=args.trace,
                               title=f"overlapc schedule: {args.target}",
                               notes=[f"world size {args.world_size}, rank {args.rank}; {settings}",
                                      f"dispatch: {header['dispatch']['described']}"])
    except ValueError as error:   # a trace that `overlapc analyze` rejects
        raise UsageError(str(error)) from None


@contextlib.contextmanager
def _process_group(world_size: int, rank: int):
    """A fake default process group for the duration; an existing one is reused if it matches."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if (dist.get_world_size(), dist.get_rank()) != (world_size, rank):
            raise UsageError(f"a process group of world size {dist.get_world_size()}, rank "
                             f"{dist.get_rank()} already exists in this process")
        yield
        return
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _dump(records, out: str, profile, say, dispatch: dict) -> None:
    from overlapc.report import write_artifacts

    for record in records:
        folder = os.path.join(out, record.name)
        write_artifacts(record, folder, profile, dispatch=dispatch)
        say(f"wrote {folder}/")


def _report(records, header: dict, profile, fmt: str, wide: bool = False, quiet: bool = False) -> str:
    """The report of every record as an "overlapc.cli.report/1" JSON document, or as text:
    a header naming target, schedule and profile, then ``report.format_graph`` per graph
    (compact within 120 columns; ``wide``: every column; ``quiet``: the summaries only)."""
    from overlapc import report

    graphs = []
    for record in records:
        rows = report.rows(record.gm, record.before_order, profile)
        graphs.append((record.name, rows, report.summary(record.gm, record.before_order, profile)))
    if fmt == "json":
        document = {"schema": REPORT_SCHEMA, **header, "graphs": [
            {"name": name, "rows": [dataclasses.asdict(r) for r in rows], "summary": summary}
            for name, rows, summary in graphs]}
        return json.dumps(document, indent=2) + "\n"
    config, device, link = header["config"], profile.device, profile.link
    lines = [
        f"overlapc report {header['target']}: world size {header['world_size']}, rank {header['rank']}",
        f"schedule: max_in_flight={_or_none(config['max_in_flight'])}, "
        f"max_in_flight_bytes={_or_none(config['max_in_flight_bytes'])}, bucket={_or_none(config['bucket'])}, "
        f"chunks={config['chunks']}, regather={config['regather']}, narrow_gathers={config['narrow_gathers']}"
        + ("" if config["enabled"] else " (disabled: OVERLAPC_DISABLE)"),
        f"profile: {profile.source or profile.name}",
        f"dispatch: {header['dispatch']['described']}",
        f"estimates: {device.name} {device.tflops:.3g} TFLOP/s, {device.mem_gbps:.3g} GB/s memory; "
        f"{link.name} {link.gbps:.3g} GB/s, {link.latency_us:.3g} us latency"
        + "".join(f"; {kind} {gbps:.3g} GB/s, {lat:.3g} us" for kind, gbps, lat in link.per_kind),
    ]
    text = "".join(line + "\n" if wide else report.wrap(line, "    ") for line in lines)
    return text + "".join("\n" + report.format_graph(*graph, wide=wide, quiet=quiet) for graph in graphs)


def _or_none(value) -> str:
    return "none" if value is None else str(value)


def _trace(records, header: dict, profile) -> dict:
    """The "overlapc.cli.timeline/1" trace document: before and after of every record."""
    from overlapc.simulate import simulate

    events = []
    for index, record in enumerate(records):
        before = simulate(record.gm, profile, record.before_order)
        after = simulate(record.gm, profile)
        events += trace_events(record.gm, before, 2 * index + 1, f"{record.name} before")
        events += trace_events(record.gm, after, 2 * index + 2, f"{record.name} after")
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schema": TIMELINE_SCHEMA, **header}}


def trace_events(gm, timeline, pid: int, label: str) -> list[dict]:
    """Chrome trace events for one simulated order of ``gm`` (an ``overlapc.simulate.Timeline``):
    process ``pid`` named ``label``, thread 0 "compute", threads 1.. "comm group <name>" (sorted
    group names), "X" events for compute ("compute"), collectives ("comm") and compute stalls on
    waits ("exposed"); ts and dur in microseconds. Deterministic."""
    nodes = {n.name: n for n in gm.graph.nodes}
    groups = sorted({t.collective.group for t in timeline.collectives.values()})
    tid = {group: index + 1 for index, group in enumerate(groups)}
    events = [{"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": label}},
              {"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": pid}},
              {"ph": "M", "pid": pid, "tid": 0, "name": "thread_name", "args": {"name": "compute"}}]
    events += [{"ph": "M", "pid": pid, "tid": tid[g], "name": "thread_name", "args": {"name": f"comm group {g}"}}
               for g in groups]

    def complete(cat, thread, name, start_ms, dur_ms, args):
        return {"ph": "X", "cat": cat, "pid": pid, "tid": thread, "name": name,
                "ts": round(start_ms * 1e3, 3), "dur": round(max(dur_ms, 0.0) * 1e3, 3), "args": args}

    for name, (start, end) in timeline.compute.items():
        if end > start:
            events.append(complete("compute", 0, _event_name(nodes[name]), start, end - start, {"node": name}))
    for name, t in timeline.collectives.items():
        c = t.collective
        args = {"node": name, "kind": c.kind, "group": c.group, "bytes": c.nbytes,
                "issue_us": round(t.issue_ms * 1e3, 3), "exposed_us": round(t.exposed_ms * 1e3, 3)}
        events.append(complete("comm", tid[c.group], _event_name(c.start), t.start_ms, t.duration_ms, args))
        if t.exposed_ms > 0:
            events.append(complete("exposed", 0, f"wait {name}", t.end_ms - t.exposed_ms, t.exposed_ms,
                                   {"node": name}))
    return events


def _event_name(node) -> str:
    """Op name ("addmm", "all_gather_into_tensor") plus the module path where known."""
    from overlapc.report import module_path

    target = node.target
    packet = getattr(target, "overloadpacket", None)
    op = packet.__name__ if packet is not None else getattr(target, "__name__", str(target))
    module = module_path(node)
    return f"{op} {module}" if module else op


def _write(path: str, trace: dict) -> None:
    """The trace with one event per line (diff-friendly), keys sorted."""
    events = ",\n".join(json.dumps(e, sort_keys=True) for e in trace["traceEvents"])
    rest = json.dumps({k: v for k, v in trace.items() if k != "traceEvents"}, sort_keys=True)
    with open(path, "w", encoding="utf-8", newline="\n") as out:
        out.write('{"traceEvents": [\n' + events + "\n],\n" + rest[1:-1] + "}\n")


if __name__ == "__main__":
    sys.exit(main())
