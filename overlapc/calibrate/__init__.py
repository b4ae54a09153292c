"""``overlapc calibrate``: measure this machine and write a profile file.

What is measured, on the process group it runs in (every rank takes part;
rank 0 writes the file):

* collectives: all_gather, reduce_scatter, all_reduce and all_to_all (the
  functional ops overlapc schedules, each waited at once) over a sweep of
  sizes; per size the median of ``repeats`` timed runs after a warm-up (the
  first collective on a new gloo pair costs ~1.5 s), the slowest rank's median
  counting. The runs of every kind and size are interleaved (round-robin), so
  a slow spell of a shared machine spreads over all of them, each timed run
  right after an untimed one of the same kind and size. Per kind a
  least-squares fit ``ms = latency + bytes x ring / bandwidth``
  in ``costmodel.collective_ms``'s convention (bytes = the full, gathered or
  unscattered, buffer; ring = ``costmodel.ring_factor``), so ``collective_ms``
  with the fitted numbers gives back the fitted times. The profile's default
  link (for other kinds) is one fit over every kind's samples.
* compute: the median time of a square fp32 matmul (FLOP/s) and of a large copy
  (bytes read + written per second), in the costmodel's roofline convention
  (rank 0), then what compiled training steps reach of those rates
  (``measure_reference``, every rank at once as in training, the slowest rank's
  numbers): two ``torch.nn.TransformerEncoderLayer`` blocks compiled with
  Inductor, one small (fixed costs dominate) and one of training sizes (the
  roofline dominates), fit ``graphs = factor x roofline + nodes x kernel_us``;
  the profile's ``device.tflops`` and ``mem_gbps`` are the matmul's and copy's
  rates divided by ``factor`` (1.2-1.9 over 24 calibrations on this 2-core
  host: the roofline at the square matmul's rate priced a step at ~0.6x),
  ``kernel_us`` the fixed cost per node of compiled code.
* a training step outside its compiled graphs (``measure_step``, every rank):
  ``device.step_us`` per step and ``device.param_us`` per parameter (the
  optimizer), which ``costmodel.outside_ms`` adds to the graphs' estimates.
* ``profiled`` (``run_in_group``; for steps that run under torch.profiler,
  as ``overlapc analyze`` measures them): the above under the profiler, the
  reference blocks' graph runs read from the profiler's spans (else: their
  steps less the step outside the graphs), ``step_us`` from the small block's
  step outside its graphs.
* collectives in the middle of compute (``measure_in_step``), the numbers the
  simulation and ``chunks="auto"`` use (``costmodel.LinkProfile``): every rank
  runs blocks of short slots of small matmuls (a step's compute between
  collectives), with no collective, with one started before
  each slot and waited after it (overlapped), with one started and waited at
  once before each slot (serial), and with two started and waited at once
  (pair), per kind at two sizes, the samples of every kind and size
  interleaved. Overlapped (its start and wait calls plus how much its
  compute slowed against compute-only), per collective, is fitted as
  ``link.issue_us`` + full bytes / ``link.issue_gbps`` (the issuing thread's
  whole cost, its wait included; the start calls inside, fitted as
  ``link.start_us`` + full bytes / ``link.start_gbps``); serial (the time in
  its calls) at the small size, less its transfer, is each kind's latency
  (on 2 gloo ranks 1.2-1.7x the back-to-back sweep's: the ranks meet at every
  collective after computing apart, and the threads wake); 2 - pair / serial
  is ``link.overlap``, how much of a collective's latency runs beside the
  collective before it. The sweep's latency over the serial one is
  ``link.met_fraction``, a collective's latency right after its group's last
  one ended, growing to all of it over ``link.gap_us``, the blocks' compute
  between two collectives. The simulator charges the start call at the issue and
  the rest of the issuing cost for the share of the collective's run that
  compute ran beside it. On a GPU the issuing cost is the launch alone.
  Between those blocks' rounds, compiled training steps of a small
  ``TransformerEncoderLayer`` are timed three ways: plain, sharded by
  ``overlapc.fsdp`` in its traced order (each collective waited at once) and
  sharded as overlapc schedules it. The latencies (serial) and the issue and
  start costs (scheduled) are scaled until the simulator, run over those
  steps' own graphs (``in_step_scales``), spends on their collectives what the
  measured steps did: ``measured.in_step``. On a 2-core host the blocks'
  compute keeps both cores busy and gloo's threads wait for one, which a
  training step's compute, in short kernels between waits, does not.

With one process (``world_size == 1``) only compute is measured; the link is
the built-in one named by ``link``, recorded as such.

Launch: ``run_local(world_size, ...)`` spawns local ranks on 127.0.0.1 (gloo);
``run_in_group()`` measures in an existing default process group (e.g. set up
from torchrun's environment by the CLI). The file follows
``overlapc.estimate.costmodel.PROFILE_SCHEMA`` and loads with ``costmodel.load_profile``.


The room: ``measure`` (compute), ``links`` (collectives), ``fitting`` (samples -> profile
document), ``run`` (a calibration in a process group or on local ranks). It may import
the compile path (``overlapc.backend``: the reference blocks are compiled as the backend
compiles them), ``overlapc.fsdp``, ``overlapc.launch``, ``overlapc.estimate`` and the
core modules; nothing imports it but the command line.
"""
from overlapc.calibrate.fitting import (
    IN_STEP_SCALE_RANGE, SLOT_MS, document, fit, fit_compute, fit_issue, in_step_scales, link_document, write,
)
from overlapc.calibrate.links import (
    ISSUE_SIZES, KINDS, QUICK_SWEEP, SWEEP, interleaved, measure_collectives, measure_in_step,
)
from overlapc.calibrate.measure import REFERENCES, measure_compute, measure_reference, measure_step
from overlapc.calibrate.run import broadcast_object, run_in_group, run_local

__all__ = ["IN_STEP_SCALE_RANGE", "ISSUE_SIZES", "KINDS", "QUICK_SWEEP", "REFERENCES", "SLOT_MS", "SWEEP",
           "broadcast_object", "document", "fit", "fit_compute", "fit_issue", "in_step_scales", "interleaved",
           "link_document", "measure_collectives", "measure_compute", "measure_in_step", "measure_reference",
           "measure_step", "run_in_group", "run_local", "write"]
