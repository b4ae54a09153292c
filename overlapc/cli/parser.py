"""The command line's parser: commands, options and their checks (what is bad input)."""
from __future__ import annotations

import argparse
import difflib
import json
import re
import textwrap

from overlapc.passes.options import bucket_plan

REPORT_SCHEMA = "overlapc.cli.report/1"


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


def _bucket(text: str):
    """--bucket: 'auto', 'module', 'none', a byte size, or a plan as a JSON list of module paths
    or lists of them ('["layers.0", ["norm", "output"]]', OverlapConfig.bucket's plan)."""
    if not text.lstrip().startswith("["):
        return _byte_limit(("auto", "module", "none"))(text)
    example = """'["layers.0", ["norm", "output"]]'"""
    try:
        plan = json.loads(text)
        bucket_plan(plan, "OverlapConfig")
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"a plan is a JSON list of module paths or lists of them, e.g. {example}; "
                                         f"{text!r} is not JSON: {error.msg}") from None
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("OverlapConfig.bucket: ")) from None
    return plan


def _choice(*words: str):
    """An argparse type taking one of ``words`` (--regather's 'always' or 'auto', --issue's 'early'
    or 'per-kernel'); anything else is one line naming them, and the closest when misspelt."""
    forms = " or ".join(repr(word) for word in words)

    def parse(text: str) -> str:
        word = _word(text, words, forms)
        if word is None:
            raise argparse.ArgumentTypeError(f"expected {forms}, got {text!r}")
        return word
    return parse


def _chunks(text: str) -> int | str:
    """--chunks: an int >= 1 (1 = off) or 'auto'."""
    forms = "an int >= 1 (1 = off) or 'auto'"
    if _word(text, ("auto",), forms) == "auto":
        return "auto"
    if not re.fullmatch(r"\s*\d+\s*", text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected {forms}, got {text!r}")
    return int(text)


def _command(commands, name: str, purpose: str, **kwargs) -> argparse.ArgumentParser:
    """A subcommand whose --help starts with its one-line ``purpose`` and ends with its examples."""
    return commands.add_parser(name, help=purpose, description=textwrap.fill(purpose, 100),
                               epilog=_EXAMPLES.get(name), formatter_class=argparse.RawDescriptionHelpFormatter,
                               **kwargs)


def _common_options() -> argparse.ArgumentParser:
    """The options dump, report and timeline share: the target, the fake world, the
    scheduling knobs (OverlapConfig's) and the estimates' profile."""
    from overlapc.estimate import costmodel

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
    common.add_argument("--max-in-flight-bytes", type=_byte_limit(("auto", "serial-peak", "graph-peak", "none")),
                        default=argparse.SUPPRESS, metavar="B|auto|serial-peak|graph-peak|none",
                        help="bytes held in flight per group, at most, e.g. 64MiB (default serial-peak: only "
                        "what fits under the serial order's peak, so the peak never rises; graph-peak: under the "
                        "higher of that and the graph's own peak as handed in; auto: twice the "
                        "group's largest collective, more where memory allows, which may raise the peak)")
    common.add_argument("--regather", type=_choice("always", "auto"), default=argparse.SUPPRESS,
                        metavar="always|auto",
                        help="joint forward+backward graphs: re-gather every parameter in the backward "
                        "(always, the default) or keep a block's forward gathers where the peak allows (auto)")
    common.add_argument("--issue", type=_choice("early", "per-kernel"), default=argparse.SUPPRESS,
                        metavar="early|per-kernel",
                        help="where a start goes: as soon as its inputs are there (early, the default) or right "
                        "before the matmul-class kernel it runs under, one per kernel (per-kernel)")
    common.add_argument("--bucket-op", dest="bucket_op", type=_choice("pack", "coalesced"),
                        default=argparse.SUPPRESS, metavar="pack|coalesced",
                        help="how a bucket is issued: one collective of a packed copy (pack, the default) or, "
                        "for reduce-scatters and all-reduces, one coalesced op over the members' own tensors")
    common.add_argument("--no-narrow-gathers", dest="narrow_gathers", action="store_false",
                        default=argparse.SUPPRESS,
                        help="gather as traced: no cast of the shard before an all-gather whose result is only "
                        "cast narrower (float8 weights; the default casts first and gathers the narrow bytes)")
    common.add_argument("--bucket", type=_bucket, default=argparse.SUPPRESS,
                        metavar="auto|module|B|PLAN|none",
                        help="merge collectives: up to the largest one (auto, the default), "
                        "one bucket per block, a byte target, a plan (a JSON list of module paths or lists "
                        """of them, one bucket per entry: '["layers.0", ["norm", "output"]]'), or none""")
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


def build_parser() -> argparse.ArgumentParser:
    from overlapc.estimate import costmodel

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
    measured = _command(commands, "analyze", "measured exposed communication per collective in a "
                        "torch.profiler trace, beside overlapc's estimates")
    _analyze_options(measured)
    _with_defaults(measured, {"dump": "default: none, measured numbers only",
                              "profile": "default: the dump's own estimates",
                              "format": "text for people or json for programs; default text",
                              "timeline": "default: none"})
    return parser


def _with_defaults(parser: argparse.ArgumentParser, defaults: dict[str, str]) -> None:
    """Each option's help ends with what it does by default (``overlapc.explain.analyze``'s own
    flags say what they do, not their defaults)."""
    for action in parser._actions:
        if action.dest in defaults and "default" not in (action.help or ""):
            action.help = f"{action.help} ({defaults[action.dest]})" if action.help else defaults[action.dest]


def _analyze_options(parser: argparse.ArgumentParser) -> None:
    """The ``overlapc analyze`` flags."""
    parser.add_argument("trace", help="a Chrome trace from torch.profiler's export_chrome_trace (one rank)")
    parser.add_argument("--dump", metavar="DIR", help="the backend's dump_dir (or `overlapc dump --out`): "
                        "match collectives to overlapc's rows, reasons and estimates")
    parser.add_argument("--profile", metavar="NAME|FILE", help="re-estimate each matched collective's time "
                        "with this profile ('device:link' or a file from `overlapc calibrate`)")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--timeline", metavar="FILE", help="also write a Chrome trace (ui.perfetto.dev) "
                        "with the measured spans beside the estimated ones")
