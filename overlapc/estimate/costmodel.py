"""Time estimates for compute nodes and collectives.

Two narrow functions, so the estimate can change without touching the
simulator:

* ``compute_ms(node, device)``: roofline time of one FX node,
  ``max(FLOPs / device FLOP rate, bytes moved / memory bandwidth)``. FLOPs come
  from ``torch.utils.flop_counter`` (the op is run on meta tensors shaped like
  its inputs' ``meta["val"]``); bytes are the node's tensor inputs plus
  outputs. Placeholders, outputs, views/aliases, getitem, collective starts and
  waits cost nothing. Never raises: a node it cannot run falls back to its
  bytes, and a node without shapes costs 0.
* ``collective_ms(collective, link, world_size)``: ``latency + bytes x ring
  factor / bandwidth`` (the standard ring-algorithm bus-bandwidth model, as in
  nccl-tests' PERFORMANCE.md), with the link's numbers for the collective's
  kind when the link has them (a calibrated profile does).

Profiles (``resolve(spec)`` / ``profile(...)``): a built-in "device:link" name
("h100:nvlink", the default; "cpu:ethernet", ...) or the path of a JSON file
written by ``overlapc calibrate`` (schema ``PROFILE_SCHEMA``, below). Every
Profile says where its numbers came from (``Profile.source``).

Profile file ("overlapc.profile/1")::

    {"schema": "overlapc.profile/1",
     "device": {"name": str, "tflops": float > 0, "mem_gbps": float > 0,
                "kernel_us": float >= 0,               # optional (0): fixed cost per op
                "step_us": float >= 0,                 # optional (0): a step outside its graphs ...
                "param_us": float >= 0},               # optional (0): ... plus this per parameter
     "link": {"name": str, "gbps": float > 0, "latency_us": float >= 0,
              "issue_us": float >= 0,                  # optional (0): compute-stream time per collective
              "issue_gbps": float >= 0,                # optional (0: none): ... plus full bytes / this
              "start_us": float >= 0,                  # optional (all of issue): its start call's part
              "start_gbps": float >= 0,                # optional (0: none): ... plus full bytes / this
              "overlap": float in [0, 1],              # optional (1): latency beside earlier transfers
              "met_fraction": float in [0, 1],         # optional (1): latency right after the last one ...
              "gap_us": float >= 0},                   # optional (0: none): ... the whole after this gap
     "collectives": {<kind>: {"gbps": float > 0, "latency_us": float >= 0,
                              "samples": [{"bytes": int, "ms": float, "fit_ms": float}, ...]}, ...},
     "measured": {...}}   # how it was measured (free form; see overlapc.calibrate)

``link`` serves kinds without an entry in ``collectives``; ``samples`` and
``measured`` are informational (not read back). Files written before issue 30
may carry ``link.busy_us`` (a collective's extra time beside compute, since
measured inside ``latency_us``): it is read and ignored.

Units: TFLOP/s for compute, GB/s (10^9 *bytes* per second) for memory and
links, microseconds for latency, milliseconds for every estimate returned.

Built-in numbers are *achieved* rates, not datasheet peaks:

=========  ===============================================================
h100       H100 SXM5: 989 TFLOP/s dense bf16 peak x 0.70 achieved on large
           GEMMs = 692 TFLOP/s; HBM3 3350 GB/s x 0.80 = 2680 GB/s.
a100       A100 SXM4 80GB: 312 TFLOP/s dense bf16 peak x 0.70 = 218 TFLOP/s;
           HBM2e 2039 GB/s x 0.80 = 1631 GB/s.
cpu        the 2-core CPU test machines of this project: ~0.08 TFLOP/s fp32
           (40 matmuls 512^2 in ~136 ms, DESIGN.md) and ~20 GB/s DRAM.
nvlink     NVLink4 (H100 SXM, NVSwitch): 450 GB/s per direction per GPU
           x 0.80 = 360 GB/s (nccl-tests bus bandwidth on 8x H100 is
           ~360-370 GB/s without NVLS); 10 us latency per collective.
ib         InfiniBand NDR 400 Gb/s per GPU = 50 GB/s x 0.90 = 45 GB/s;
           20 us latency (inter-node NCCL small-message latency).
ethernet   100 Gb/s Ethernet (RoCE / TCP) = 12.5 GB/s x 0.80 = 10 GB/s;
           50 us latency.
=========  ===============================================================
"""
from __future__ import annotations

import dataclasses
import json
import operator
import os

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from overlapc.collectives import KINDS, Collective, collective_op, is_alias, is_wait, size_hint


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """An accelerator: achieved dense FLOP rate (TFLOP/s), memory bandwidth (GB/s), and
    ``kernel_us``, the fixed cost of running one op (dispatch, launch), added to every
    compute node that moves bytes or does FLOPs (0 for the built-in GPUs: their launches
    overlap the running kernels). ``step_us`` and ``param_us``: the host's time per
    training step outside its compiled graphs, fixed and per parameter (``outside_ms``;
    0 for the built-in devices)."""

    name: str
    tflops: float
    mem_gbps: float
    kernel_us: float = 0.0
    step_us: float = 0.0
    param_us: float = 0.0


@dataclasses.dataclass(frozen=True)
class LinkProfile:
    """A collective link, the one model of a collective's time that the simulator
    (``overlapc.estimate.simulate``) and ``chunks="auto"`` (``passes/chunk/estimate.py``) both use.

    A collective of ``kind`` moving ``nbytes`` full bytes over ``n`` ranks takes
    ``latency_ms(kind)`` + ``transfer_ms(kind, nbytes, n)`` (latency + full bytes x ring factor /
    bus bandwidth, ``gbps`` GB/s per GPU; ``per_kind``: ((kind, gbps, latency_us), ...) measured
    per collective kind, sorted by kind; other kinds use ``gbps`` and ``latency_us``). The
    collectives of one process group move their bytes one after another in issue order;
    ``overlap`` (0..1) is how much of a collective's latency runs while the collectives before
    it still hold the link (``end_ms``): 1, the latency never holds the link (the built-ins;
    ``overlapc calibrate`` measures it), 0, collectives run strictly one after another.

    What a collective costs the compute stream (the issuing thread): ``issue_ms(nbytes)`` =
    ``issue_us`` + full bytes / ``issue_gbps`` (0: no per-byte part), of which
    ``start_ms(nbytes)`` (``start_us`` + bytes / ``start_gbps``; None: all of it) is the start
    call itself; the rest is the backend's CPU work around the collective's run (a CPU
    backend's threads and the completion at its wait), which ``overlapc.estimate.simulate`` charges to
    compute only where the compute stream does not idle during the run. 0 for the built-in GPU
    links, where a launch costs the GPU nothing."""

    name: str
    gbps: float
    latency_us: float
    per_kind: tuple[tuple[str, float, float], ...] = ()
    issue_us: float = 0.0
    issue_gbps: float = 0.0
    start_us: float | None = None
    start_gbps: float = 0.0
    overlap: float = 1.0
    met_fraction: float = 1.0
    gap_us: float = 0.0

    def issue_ms(self, nbytes: int | None) -> float:
        """The compute stream's time for issuing one collective of ``nbytes`` full bytes (ms)."""
        per_byte = (nbytes or 0) / (self.issue_gbps * 1e9) * 1e3 if self.issue_gbps > 0 else 0.0
        return self.issue_us * 1e-3 + per_byte

    def start_ms(self, nbytes: int | None) -> float:
        """The part of ``issue_ms(nbytes)`` spent in the start call (ms): all of it when
        ``start_us`` is None, never more."""
        if self.start_us is None:
            return self.issue_ms(nbytes)
        per_byte = (nbytes or 0) / (self.start_gbps * 1e9) * 1e3 if self.start_gbps > 0 else 0.0
        return min(self.issue_ms(nbytes), self.start_us * 1e-3 + per_byte)

    def for_kind(self, kind: str) -> tuple[float, float]:
        """(gbps, latency_us) for collectives of ``kind``."""
        for name, gbps, latency_us in self.per_kind:
            if name == kind:
                return gbps, latency_us
        return self.gbps, self.latency_us

    def latency_ms(self, kind: str) -> float:
        """A ``kind`` collective's latency (ms)."""
        return self.for_kind(kind)[1] * 1e-3

    def transfer_ms(self, kind: str, nbytes: int | None, n: int | None) -> float:
        """The link's time for a ``kind`` collective's ``nbytes`` full bytes over ``n`` ranks:
        bytes x ``ring_factor(kind, n)`` / bandwidth (ms); 0 for unknown sizes."""
        return (nbytes or 0) * ring_factor(kind, n) / (self.for_kind(kind)[0] * 1e9) * 1e3

    def duration_ms(self, kind: str, nbytes: int | None, n: int | None) -> float:
        """latency + transfer of one ``kind`` collective on an idle link (ms)."""
        return self.latency_ms(kind) + self.transfer_ms(kind, nbytes, n)

    def latency_after_ms(self, issue_ms: float, free_ms: float | None, latency_ms: float) -> float:
        """The latency of a collective issued at ``issue_ms`` whose group's last collective
        ended at ``free_ms`` (None: none before it): ``met_fraction`` of ``latency_ms`` when it
        is issued before or as that one ends (the ranks have just met), growing linearly to
        all of it once ``gap_us`` has passed since (ranks drift apart while they compute
        between collectives); all of it when nothing came before or ``gap_us`` is 0 (in ms)."""
        gap_ms = self.gap_us * 1e-3
        if free_ms is None or gap_ms <= 0:
            return latency_ms
        grown = min(1.0, max(0.0, issue_ms - free_ms) / gap_ms)
        return latency_ms * (self.met_fraction + (1.0 - self.met_fraction) * grown)

    def end_ms(self, issue_ms: float, free_ms: float | None, latency_ms: float, transfer_ms: float) -> float:
        """When a collective issued at ``issue_ms`` ends, its group's link being busy with the
        collectives issued before it until ``free_ms`` (None: nothing before it): its bytes
        move after its latency (``latency_after_ms``) and after the link is free, and
        ``1 - overlap`` of its latency cannot start before then:
        ``max(issue + latency, free + (1 - overlap) x latency) + transfer``."""
        latency_ms = self.latency_after_ms(issue_ms, free_ms, latency_ms)
        free_ms = 0.0 if free_ms is None else free_ms
        return max(issue_ms + latency_ms, free_ms + (1.0 - self.overlap) * latency_ms) + transfer_ms


@dataclasses.dataclass(frozen=True)
class Profile:
    """What the simulator needs: one device and the link its collectives use.

    ``name``: "h100:nvlink" for built-ins, the file's path for a calibrated
    profile; ``source``: where the numbers came from, for people (report headers).
    ``links``: ((key, LinkProfile), ...), the link of the process groups a key names (a
    mesh dim name, e.g. "dp_shard", or a group name); other groups use ``link``."""

    device: DeviceProfile
    link: LinkProfile
    name: str = ""
    source: str = ""
    links: tuple[tuple[str, LinkProfile], ...] = ()

    def compute_ms(self, node: fx.Node) -> float:
        """``compute_ms(node, self.device)``: one node's estimate on this device (ms)."""
        return compute_ms(node, self.device)

    def fixed_ms(self) -> float:
        """The device's fixed cost of one op (``kernel_us``), in ms."""
        return self.device.kernel_us * 1e-3

    def link_for(self, group: str) -> LinkProfile:
        """The link of process group ``group`` (its name): by group name, then by its mesh
        dim name (``group_label``), else the default ``link``."""
        if self.links:
            keys = dict(self.links)
            for key in (str(group), group_label(group)):
                if key in keys:
                    return keys[key]
        return self.link


DEVICES = {
    "h100": DeviceProfile("h100", tflops=989.0 * 0.70, mem_gbps=3350.0 * 0.80),
    "a100": DeviceProfile("a100", tflops=312.0 * 0.70, mem_gbps=2039.0 * 0.80),
    "cpu": DeviceProfile("cpu", tflops=0.08, mem_gbps=20.0),
}
LINKS = {
    "nvlink": LinkProfile("nvlink", gbps=450.0 * 0.80, latency_us=10.0),
    "ib": LinkProfile("ib", gbps=50.0 * 0.90, latency_us=20.0),
    "ethernet": LinkProfile("ethernet", gbps=12.5 * 0.80, latency_us=50.0),
}


PROFILE_SCHEMA = "overlapc.profile/1"
DEFAULT = "h100:nvlink"
CPU_DEFAULT = "cpu:ethernet"   # a run on CPU tensors over gloo, when no profile is given


def default_for(device_type: str | None, backend: str | None) -> str:
    """The profile a compile uses when its options give none: ``CPU_DEFAULT`` when it
    runs on CPU tensors over gloo (the H100 numbers would call every collective exposed
    and every compute free there), else ``DEFAULT``. A calibrated file is always given
    explicitly (``options={"profile": FILE}``, ``--profile FILE``)."""
    if device_type == "cpu" and backend is not None and "gloo" in backend:
        return CPU_DEFAULT
    return DEFAULT


def profile(device: str = "h100", link: str | None = None, tflops: float | None = None,
            mem_gbps: float | None = None, link_gbps: float | None = None,
            latency_us: float | None = None) -> Profile:
    """A Profile from built-in names, or from a "device:link" name or a profile file
    path given as ``device``, with any number given explicitly replacing the
    profile's own (``link_gbps``/``latency_us`` then apply to every kind).

    ``link`` defaults to "nvlink" for a built-in device; it may name a link per mesh dim
    or process group, "shard=nvlink,replicate=ib" (a bare name among them sets the
    default link, else nvlink). Unknown names raise ValueError listing the valid ones;
    overrides must be positive (latency may be 0) and apply to every link.
    """
    for name, value in (("tflops", tflops), ("mem_gbps", mem_gbps), ("link_gbps", link_gbps)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    if latency_us is not None and not latency_us >= 0:
        raise ValueError(f"latency_us must be >= 0, got {latency_us!r}")
    if device not in DEVICES and (":" in str(device) or _looks_like_file(device)):
        if link is not None:
            raise ValueError(f"give either a profile ({device!r}) or a link ({link!r}), not both")
        base = resolve(device)
    else:
        if device not in DEVICES:
            raise ValueError(f"unknown device {device!r}; valid: {', '.join(DEVICES)} "
                             f"(or a 'device:link' name, or a profile file written by overlapc calibrate)")
        link = "nvlink" if link is None else link
        default, links = _link_spec(link)
        base = Profile(DEVICES[device], LINKS[default], f"{device}:{link}", f"built-in {device}:{link}",
                       links)
    overrides = [f"{k}={v:g}" for k, v in (("tflops", tflops), ("mem_gbps", mem_gbps),
                                             ("link_gbps", link_gbps), ("latency_us", latency_us))
                 if v is not None]
    if not overrides:
        return base
    dev = dataclasses.replace(base.device, **{k: v for k, v in (("tflops", tflops), ("mem_gbps", mem_gbps))
                                              if v is not None})

    def override(lnk: LinkProfile) -> LinkProfile:
        lnk = dataclasses.replace(lnk, **{k: v for k, v in (("gbps", link_gbps), ("latency_us", latency_us))
                                          if v is not None})
        return dataclasses.replace(lnk, per_kind=tuple(
            (kind, gbps if link_gbps is None else link_gbps, lat if latency_us is None else latency_us)
            for kind, gbps, lat in lnk.per_kind))
    return Profile(dev, override(base.link), base.name, f"{base.source}, with {', '.join(overrides)}",
                   tuple((key, override(lnk)) for key, lnk in base.links))


def _link_spec(spec: str) -> tuple[str, tuple[tuple[str, LinkProfile], ...]]:
    """"ib" -> ("ib", ()); "shard=nvlink,replicate=ib" -> ("nvlink", (("replicate", ib), ("shard", nvlink)))."""
    default, links = None, {}
    for entry in str(spec).split(","):
        key, sep, name = (part.strip() for part in entry.partition("="))
        name = name if sep else key
        if name not in LINKS or (sep and not key):
            raise ValueError(f"unknown link {entry.strip()!r} in {spec!r}; valid: {', '.join(LINKS)}, "
                             f"or per mesh dim / group: 'shard=nvlink,replicate=ib'")
        if sep:
            links[key] = LINKS[name]
        elif default is not None:
            raise ValueError(f"{spec!r} names two default links ({default}, {name})")
        else:
            default = name
    return default or "nvlink", tuple(sorted(links.items()))


def _is_link_spec(spec: str) -> bool:
    try:
        _link_spec(spec)
        return True
    except ValueError:
        return False


def _looks_like_file(spec) -> bool:
    text = os.fspath(spec) if isinstance(spec, os.PathLike) else str(spec)
    return text.endswith(".json") or os.sep in text or "/" in text or os.path.isfile(text)


def resolve(spec: "str | os.PathLike | Profile | None" = None) -> Profile:
    """The Profile a spec names: None -> the default ("h100:nvlink"); a Profile as it is;
    "device:link" -> built-in; anything else -> a profile file (``load_profile``).
    ValueError naming the valid built-ins when the spec is neither."""
    if spec is None:
        base = profile("h100", "nvlink")
        return dataclasses.replace(base, source=f"built-in {DEFAULT} (the default)")
    if isinstance(spec, Profile):
        return spec
    text = os.fspath(spec) if isinstance(spec, os.PathLike) else spec
    if not isinstance(text, str):
        raise ValueError(f"a profile is a 'device:link' name or a file path, got {spec!r}")
    device, sep, link = text.partition(":")
    if sep and device in DEVICES and _is_link_spec(link) and not os.path.exists(text):
        return profile(device, link)
    if os.path.isfile(text):
        return load_profile(text)
    if sep and not _looks_like_file(text):
        raise ValueError(f"unknown profile {text!r}; built-in: "
                         f"{', '.join(f'{d}:{k}' for d in DEVICES for k in LINKS)}")
    raise ValueError(f"no profile file {text!r}: give a built-in 'device:link' name "
                     f"({', '.join(f'{d}:{k}' for d in DEVICES for k in LINKS)}) or a file "
                     f"written by `overlapc calibrate -o FILE`")


def _number(where: str, value, floor: float, strict: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not (value > floor if strict else value >= floor) or value != value or value == float("inf"):
        raise ValueError(f"{where} must be a number {'>' if strict else '>='} {floor:g}, got {value!r}")
    return float(value)


def profile_to_text(profile: Profile) -> str:
    """``profile`` as JSON text, every field (what ``profile_from_text`` reads back)."""
    return json.dumps(dataclasses.asdict(profile), sort_keys=True)


def profile_from_text(text: str, via: str) -> Profile:
    """The Profile ``profile_to_text`` wrote (tuples come back from JSON lists), its
    source read "VIA (SOURCE)": ``via`` says how it arrived."""
    document = json.loads(text)

    def link(fields: dict) -> LinkProfile:
        return LinkProfile(**{**fields, "per_kind": tuple(tuple(k) for k in fields["per_kind"])})
    return Profile(DeviceProfile(**document["device"]), link(document["link"]), document["name"],
                   f"{via} ({document['source']})",
                   tuple((key, link(value)) for key, value in document["links"]))


def _fraction(where: str, value) -> float:
    value = _number(where, value, 0, False)
    if value > 1:
        raise ValueError(f"{where} must be a number in [0, 1], got {value!r}")
    return value


def profile_from_json(document: dict, source: str = "", name: str = "") -> Profile:
    """A Profile from a parsed profile file (schema in the module docstring);
    ValueError naming the first field that is missing or wrong."""
    if not isinstance(document, dict) or document.get("schema") != PROFILE_SCHEMA:
        found = document.get("schema") if isinstance(document, dict) else type(document).__name__
        raise ValueError(f"{source or 'profile'}: schema must be {PROFILE_SCHEMA!r}, got {found!r} "
                         f"(write it with `overlapc calibrate -o FILE`)")
    where = source or "profile"
    try:
        dev, lnk = document["device"], document["link"]
        device = DeviceProfile(str(dev["name"]), _number(f"{where}: device.tflops", dev["tflops"], 0, True),
                               _number(f"{where}: device.mem_gbps", dev["mem_gbps"], 0, True),
                               _number(f"{where}: device.kernel_us", dev.get("kernel_us", 0.0), 0, False),
                               _number(f"{where}: device.step_us", dev.get("step_us", 0.0), 0, False),
                               _number(f"{where}: device.param_us", dev.get("param_us", 0.0), 0, False))
        per_kind = []
        for kind, numbers in sorted((document.get("collectives") or {}).items()):
            per_kind.append((str(kind), _number(f"{where}: collectives.{kind}.gbps", numbers["gbps"], 0, True),
                             _number(f"{where}: collectives.{kind}.latency_us", numbers["latency_us"], 0, False)))
        link = LinkProfile(str(lnk["name"]), _number(f"{where}: link.gbps", lnk["gbps"], 0, True),
                           _number(f"{where}: link.latency_us", lnk["latency_us"], 0, False), tuple(per_kind),
                           _number(f"{where}: link.issue_us", lnk.get("issue_us", 0.0), 0, False),
                           _number(f"{where}: link.issue_gbps", lnk.get("issue_gbps", 0.0), 0, False),
                           None if lnk.get("start_us") is None
                           else _number(f"{where}: link.start_us", lnk["start_us"], 0, False),
                           _number(f"{where}: link.start_gbps", lnk.get("start_gbps", 0.0), 0, False),
                           _fraction(f"{where}: link.overlap", lnk.get("overlap", 1.0)),
                           _fraction(f"{where}: link.met_fraction", lnk.get("met_fraction", 1.0)),
                           _number(f"{where}: link.gap_us", lnk.get("gap_us", 0.0), 0, False))
    except (KeyError, TypeError) as error:
        raise ValueError(f"{where}: missing or malformed field {error} (schema {PROFILE_SCHEMA})") from None
    return Profile(device, link, name, source)


def read_json(path: str, what: str):
    """The parsed JSON file at ``path``; ValueError naming ``what`` ("profile",
    "trace") and the path when it cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as source:
            return json.load(source)
    except OSError as error:
        raise ValueError(f"cannot read {what} {path}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{what} {path} is not JSON: {error}") from None


def load_profile(path: "str | os.PathLike") -> Profile:
    """The Profile in a file written by ``overlapc calibrate``; ValueError when it cannot be
    read or does not follow the schema."""
    path = os.fspath(path)
    document = read_json(path, "profile")
    measured = document.get("measured") if isinstance(document, dict) else None
    how = ""
    if isinstance(measured, dict):
        parts = [f"{measured[k]}" for k in ("backend", "host", "created") if measured.get(k)]
        if measured.get("world_size"):
            parts.insert(1, f"{measured['world_size']} ranks")
        how = f" (calibrated: {', '.join(parts)})" if parts else ""
    return profile_from_json(document, source=f"file {path}{how}", name=path)


# -- compute --------------------------------------------------------------------------------------

def _sizes(sizes) -> tuple[int, ...] | None:
    """Sizes as concrete ints (``size_hint``s for symbolic ones, torch's guess for
    data-dependent ones: an estimate, never a guard), or None when one is unknown."""
    sizes = tuple(sizes)
    if all(type(s) is int for s in sizes):
        return sizes
    sizes = tuple(size_hint(s, unbacked=True) for s in sizes)
    return None if any(s is None for s in sizes) else sizes


_UNKNOWN = ("unknown",)   # signature of a value whose sizes are not known
_MISSING = object()       # stands for a node input without a recorded value


def _signature(value):
    """Hashable ("tensor", shape, stride, dtype) of a tensor, _UNKNOWN when its sizes are not
    concrete; lists recurse; other values pass through when hashable (else their repr)."""
    if isinstance(value, torch.Tensor):
        shape = _sizes(value.shape)
        if shape is None:
            return _UNKNOWN
        try:
            stride = _sizes(value.stride())
        except Exception:  # sparse and other layouts without strides
            stride = None
        return ("tensor", shape, stride, value.dtype)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_signature(v) for v in value))
    if value is _MISSING or isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _UNKNOWN
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


def _is_tensor_sig(sig) -> bool:
    return isinstance(sig, tuple) and len(sig) == 4 and sig[0] == "tensor"


def _is_list_sig(sig) -> bool:
    return isinstance(sig, tuple) and len(sig) == 2 and sig[0] in ("list", "tuple")


def _nbytes(sig) -> int:
    """Bytes of every tensor in a signature (0 for unknown sizes and non-tensors)."""
    if _is_tensor_sig(sig):
        numel = 1
        for s in sig[1]:
            numel *= s
        return numel * sig[3].itemsize
    if _is_list_sig(sig):
        return sum(_nbytes(s) for s in sig[1])
    return 0


def _known(sig) -> bool:
    """True when no tensor or size inside the signature is unknown."""
    if sig == _UNKNOWN:
        return False
    return all(_known(s) for s in sig[1]) if _is_list_sig(sig) else True


def _meta(sig):
    """A meta tensor (or list of them) rebuilt from a signature."""
    if _is_tensor_sig(sig):
        if sig[2] is None:
            return torch.empty(sig[1], dtype=sig[3], device="meta")
        return torch.empty_strided(sig[1], sig[2], dtype=sig[3], device="meta")
    if _is_list_sig(sig):
        values = [_meta(s) for s in sig[1]]
        return values if sig[0] == "list" else tuple(values)
    return sig


def _counts_flops(target) -> bool:
    """Only ops the flop counter knows (or that decompose into them) are worth running."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target.overloadpacket in flop_registry:
        return True
    return torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd")


def _flops(target, args_sig, kwargs_sig) -> int:
    """FLOPs of ``target`` on meta tensors rebuilt from signatures; 0 when it cannot run."""
    if not _counts_flops(target) or not all(_known(s) for s in (*args_sig, *(s for _, s in kwargs_sig))):
        return 0
    try:
        args = [_meta(s) for s in args_sig]
        kwargs = {k: _meta(s) for k, s in kwargs_sig}
        with FlopCounterMode(display=False) as counter:
            target(*args, **kwargs)
        return int(counter.get_total_flops())
    except Exception:
        return 0


_FREE_OPS = ("placeholder", "output", "get_attr")
_cache: dict = {}   # (target, arg signatures, out signature) -> (flops, bytes)


def _value_of(arg):
    """The recorded example value behind an FX argument (nodes replaced by meta['val'])."""
    return fx.node.map_aggregate(arg, lambda a: a.meta.get("val", _MISSING) if isinstance(a, fx.Node) else a)


_free_targets: dict = {}   # (op, target) -> True for views, getitem, collective starts and waits


def _free(node: fx.Node) -> bool:
    key = (node.op, node.target)
    try:
        return _free_targets[key]
    except KeyError:
        free = node.target is operator.getitem or is_alias(node) or is_wait(node) \
            or collective_op(node) is not None
        _free_targets[key] = free
        return free
    except TypeError:   # unhashable target
        return is_alias(node)


def _has_tensor(value) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return isinstance(value, torch.Tensor)


def node_cost(node: fx.Node) -> tuple[int, int]:
    """(FLOPs, bytes moved) of one node; (0, 0) for nodes that cost nothing or have no shapes."""
    if node.op in _FREE_OPS or _free(node):
        return 0, 0
    if "val" in node.meta and not _has_tensor(node.meta["val"]):
        return 0, 0   # sizes, scalars, None: bookkeeping, not device work
    try:
        args_sig = tuple(_signature(_value_of(a)) for a in node.args)
        kwargs_sig = tuple((k, _signature(_value_of(v))) for k, v in node.kwargs.items())
        out_sig = _signature(node.meta.get("val"))
        key = (node.target, args_sig, kwargs_sig, out_sig)
        cached = _cache.get(key)
        if cached is None:
            moved = sum(_nbytes(s) for s in args_sig) + sum(_nbytes(s) for _, s in kwargs_sig) \
                + _nbytes(out_sig)
            cached = (_flops(node.target, args_sig, kwargs_sig), moved)
            _cache[key] = cached
        return cached
    except Exception:  # unhashable targets, odd metadata: whatever the node is, keep going
        return 0, 0


def compute_ms(node: fx.Node, device: DeviceProfile) -> float:
    """Estimate of one node on ``device``, in ms: the roofline max(FLOPs/rate, bytes/bandwidth)
    plus the device's fixed cost per op (``kernel_us``) when the node does any work."""
    flops, moved = node_cost(node)
    if not (flops or moved):
        return 0.0
    return max(flops / (device.tflops * 1e12), moved / (device.mem_gbps * 1e9)) * 1e3 + device.kernel_us * 1e-3


def outside_ms(parameters: int, device: DeviceProfile) -> float:
    """Estimate of a training step's time outside its compiled graphs (guards, runtime
    wrappers, the autograd engine, the loss, an SGD step and zero_grad) with ``parameters``
    parameter tensors, in ms: ``step_us + parameters x param_us`` (``overlapc calibrate``
    measures both)."""
    return (device.step_us + parameters * device.param_us) * 1e-3


# -- communication -------------------------------------------------------------------------------

def group_label(group: str) -> str:
    """The mesh dim name of process group ``group`` ("dp_shard") where a DeviceMesh created
    it with named dims (c10d's group description "mesh_<name>"), else ``group`` itself."""
    group = str(group)
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group
        desc = str(getattr(_resolve_process_group(group), "group_desc", "") or "")
    except Exception:   # no process group of that name (a dump read elsewhere, a test graph)
        return group
    if desc.startswith("mesh_") and desc != "mesh_default" and not desc.startswith("mesh_dim_"):
        return desc[len("mesh_"):]
    return group

def ring_factor(kind: str, n: int | None) -> float:
    """What a ``kind`` collective's full bytes are multiplied by for ``n`` ranks (the ring
    algorithm: each rank sends (n-1)/n of the full buffer once per phase, ``collectives.KINDS``'
    ring phases): (n-1)/n for all_gather, reduce_scatter and all_to_all, 2(n-1)/n for
    all_reduce, the large-n limit (1, 2) when ``n`` is unknown, 1 for broadcast and unknown kinds."""
    phases = KINDS[kind].ring_phases if kind in KINDS else None
    if phases is None:
        return 1.0
    return phases * ((n - 1) / n if n else 1.0)


def _group_size(c: Collective, world_size: int | None) -> int | None:
    if c.group_size is not None:
        return c.group_size
    if world_size is not None:
        return world_size
    try:  # all_reduce and friends do not name their group size: ask the process group
        from torch.distributed.distributed_c10d import _resolve_process_group
        return int(_resolve_process_group(c.group).size())
    except Exception:
        return None


def collective_bytes(c: Collective) -> int | None:
    """Bytes the collective's bandwidth term is charged for: the full (gathered or
    unscattered) size, i.e. the output of an all-gather and the input of a reduce-scatter."""
    if c.kind == "reduce_scatter" and c.start.args and isinstance(c.start.args[0], (fx.Node, list, tuple)):
        full = _nbytes(_signature(_value_of(c.start.args[0])))
        if full:
            return full
    return c.nbytes


def link_ms(collective: Collective, link: LinkProfile, world_size: int | None = None) -> tuple[float, float]:
    """(latency, transfer) of ``collective`` on ``link`` (ms): ``link.latency_ms`` and
    ``link.transfer_ms`` for its kind and full bytes (``collective_bytes``) over n ranks, n its
    group size, else ``world_size``, else the size of its process group if one is registered;
    unknown: the ring factor's large-n limit. Unknown sizes cost latency only."""
    n = _group_size(collective, world_size)
    return link.latency_ms(collective.kind), link.transfer_ms(collective.kind, collective_bytes(collective), n)


def collective_ms(collective: Collective, link: LinkProfile, world_size: int | None = None) -> float:
    """latency + full bytes x ring factor / bandwidth of ``collective`` on an idle link
    (``link_ms`` summed; ``LinkProfile.duration_ms``), in ms."""
    return sum(link_ms(collective, link, world_size))
