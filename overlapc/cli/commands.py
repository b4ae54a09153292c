"""``overlapc dump | report | timeline | calibrate | demo``: capture, schedule and explain a model's graphs.

TARGET is ``path/to/file.py:function`` or ``module:function``. The function
takes no arguments and returns ``(model, example_inputs)``; it runs after the
CLI has initialised a fake process group (backend "fake": no network, any
world size) of ``--world-size`` ranks as ``--rank``, so it may build device
meshes and shard the model (``overlapc.fsdp.shard``). The CLI then captures one
forward and backward and works on the scheduled graphs ("fw_0", "bw_0", ...;
``--graph fw|bw|all`` selects). ``--dispatch auto|cuda|cpu`` says how: cuda
captures the graphs as the CUDA compile makes them (``overlapc.backend.cuda_capture``: a
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
numbers (``overlapc.estimate.costmodel.profile``); ``--profile`` beats
``--device``/``--link``. Every report names the profile it used and where it
came from.

    overlapc dump TARGET --world-size N [--out DIR]
        DIR/<graph>/before.txt, after.txt, report.txt, report.json
        (``overlapc.explain.report.write_artifacts``; report.json is "overlapc.report/1",
        with the "dispatch" entry).
    overlapc report TARGET --world-size N [--format text|json] [--wide] [--quiet]
                    [--html FILE [--trace TRACE]]
        A summary per graph and one row per collective, on stdout: compact
        rows within 120 columns (``overlapc.explain.report.format_graph``), every
        column with ``--wide``, the summaries only with ``--quiet``. ``--html``
        also writes one self-contained page (``overlapc.explain.html_report``): per
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
        ``overlapc.cli.demo.main(ARGS)``.

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
     "config": {"max_in_flight": 2 | null, "max_in_flight_bytes": int | "auto" | "serial-peak" | "graph-peak" | null,
                "bucket": "auto" | "module" | int | [[module path, ...], ...] | null, "bucket_op": "pack" | "coalesced",
                "chunks": int | "auto",
                "regather": "always" | "auto", "issue": "early" | "per-kernel", "narrow_gathers": bool,
                "enabled": bool},
     "profile": {"device": {"name", "tflops", "mem_gbps"},
                 "link": {"name", "gbps", "latency_us", "per_kind": [[kind, gbps, latency_us], ...]},
                 "name": "h100:nvlink" | profile file path, "source": where the numbers came from},
     "dispatch": {"device": "cuda" | "cpu", "attention": ["efficient", ...], "partitioner": "min-cut" | "default",
                  "described": "cuda (fake H100, efficient attention, min-cut partitioner)" | "cpu"},
     "graphs": [{"name": "fw_0",
                 "rows": [<overlapc.explain.report.Row fields>, ...],   # issue order after
                 "summary": {<overlapc.explain.report.summary keys>}}, ...]}

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
import dataclasses
import json
import os
import sys
import tempfile

from overlapc.cli.parser import REPORT_SCHEMA, UsageError, build_parser
from overlapc.cli.targets import build_model, fake_process_group, load_target
from overlapc.cli.timeline import timeline_document, write_timeline


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit code (0 ok, 2 bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        return _demo(argv[1:])
    try:
        args = build_parser().parse_args(argv)
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
        from overlapc.cli import demo
    except ModuleNotFoundError as error:
        if error.name not in ("overlapc.cli.demo",):
            raise
        print("overlapc demo: error: overlapc.cli.demo is not installed", file=sys.stderr)
        return 2
    return int(demo.main(argv) or 0)


def estimates(args: argparse.Namespace):
    """The Profile the flags ask for: --profile beats --device/--link; explicit numbers beat both."""
    from overlapc.estimate import costmodel

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
    from overlapc.backend import cuda_capture
    from overlapc.collectives import collectives
    from overlapc.config import OverlapConfig

    if args.command == "calibrate":
        return _calibrate(args)
    if args.command == "analyze":
        return _analyze(args)
    if args.world_size < 1:
        raise UsageError(f"world size must be >= 1, got {args.world_size}")
    if not 0 <= args.rank < args.world_size:
        raise UsageError(f"rank {args.rank} is not in [0, {args.world_size})")
    options = {k: getattr(args, k) for k in ("max_in_flight", "max_in_flight_bytes", "bucket", "bucket_op", "chunks",
                                             "regather", "issue", "narrow_gathers") if hasattr(args, k)}
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
    build = load_target(args.target)

    def say(message: str) -> None:
        if not args.quiet:
            print(message, file=sys.stderr, flush=True)

    if args.profile is not None and (args.device or args.link):
        say(f"using --profile {args.profile}; --device/--link ignored")
    if args.profile is not None:
        options["profile"] = args.profile   # the backend's own log lines use it too

    with fake_process_group(args.world_size, args.rank):
        built = build_model(build, args.target)
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
                                                          "bucket_op", "chunks", "regather", "issue",
                                                          "narrow_gathers", "enabled")},
                  "profile": dataclasses.asdict(profile), "dispatch": dispatch.as_dict()}
        if args.command == "dump":
            _dump(records, args.out, profile, say, header["dispatch"])
        elif args.command == "report":
            sys.stdout.write(_report(records, header, profile, args.format, args.wide, args.quiet))
            if args.html:
                _write_html(args, records, header, profile, cfg)
                say(f"wrote {args.html}")
        else:
            write_timeline(args.out, timeline_document(records, header, profile))
            say(f"wrote {args.out} (open in https://ui.perfetto.dev or chrome://tracing)")
    return 0


def _require_cuda_capture() -> None:
    """UsageError, naming what to install or pass, when the CUDA-shaped capture cannot run."""
    from overlapc.backend import cuda_capture
    try:
        cuda_capture.require_triton()
    except cuda_capture.CaptureUnavailable as error:
        raise UsageError(str(error)) from None


def _capture(built, options: dict, device: str, notes: list[str]):
    """(records, dispatch): one training step of ``built`` = (model, inputs) captured as
    ``device`` ("cuda" | "cpu", ``overlapc.backend.cuda_capture.capture_as``) and scheduled."""
    from overlapc.backend import cuda_capture
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


def _write_html(args: argparse.Namespace, records, header: dict, profile, cfg) -> None:
    """``report --html``: the records' schedule page (``overlapc.explain.html_report``)."""
    from overlapc.explain import html_report

    settings = ", ".join(f"{k}={v}" for k, v in header["config"].items())
    try:
        html_report.write_html(args.html, records, profile, cfg, trace=args.trace,
                               title=f"overlapc schedule: {args.target}",
                               notes=[f"world size {args.world_size}, rank {args.rank}; {settings}",
                                      f"dispatch: {header['dispatch']['described']}"])
    except ValueError as error:   # a trace that `overlapc analyze` rejects
        raise UsageError(str(error)) from None


def _dump(records, out: str, profile, say, dispatch: dict) -> None:
    from overlapc.explain.report import write_artifacts

    for record in records:
        folder = os.path.join(out, record.name)
        write_artifacts(record, folder, profile, dispatch=dispatch)
        say(f"wrote {folder}/")


def _report(records, header: dict, profile, fmt: str, wide: bool = False, quiet: bool = False) -> str:
    """The report of every record as an "overlapc.cli.report/1" JSON document, or as text:
    a header naming target, schedule and profile, then ``report.format_graph`` per graph
    (compact within 120 columns; ``wide``: every column; ``quiet``: the summaries only)."""
    from overlapc.explain import report

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
        f"bucket_op={config['bucket_op']}, chunks={config['chunks']}, regather={config['regather']}, "
        f"issue={config['issue']}, "
        f"narrow_gathers={config['narrow_gathers']}"
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


def _analyze(args: argparse.Namespace) -> int:
    """``overlapc analyze``: print the analysis; 2 with one line on stderr for bad input."""
    from overlapc.explain import analysis_output, analyze

    try:
        result = analyze.analyze(args.trace, args.dump, args.profile)
        if getattr(args, "timeline", None):
            with open(args.timeline, "w", encoding="utf-8", newline="\n") as out:
                json.dump(analysis_output.timeline(result), out)
    except ValueError as error:
        print(f"overlapc analyze: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"overlapc analyze: error: cannot write {args.timeline}: {error.strerror or error}", file=sys.stderr)
        return 2
    sys.stdout.write(json.dumps(analysis_output.to_json(result), indent=2) + "\n" if args.format == "json"
                     else analysis_output.format_text(result))
    return 0
