"""`aot.overlap`: the exposed communication of a scheduled HLO module, replayed against
the chip's compute peak and link rates, checked on a hand-built schedule whose overlap
is worked out by hand. (A compiled TPU module: `test_aot.py`.)"""

import pytest

from tunix_core.aot import overlap

PEAK, ICI = 197e12, 200e9  # v5e: bf16 flop/s, ICI collective bytes/s
GROUP = "replica_groups={{0,1,2,3}}"

HLO = f"""HloModule hand, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

%tpu_start (p0: bf16[262144]) -> (bf16[262144], bf16[1048576], u32[]) {{
  %p0 = bf16[262144]{{0}} parameter(0)
  %ag = bf16[1048576]{{0}} all-gather(%p0), channel_id=1, {GROUP}, dimensions={{0}}
  ROOT %cc = (bf16[262144]{{0}}, bf16[1048576]{{0}}, u32[]) custom-call(%ag), custom_call_target="AsyncCollectiveStart"
}}

%tpu_done (p0: bf16[262144], p1: bf16[1048576]) -> bf16[1048576] {{
  %p0 = bf16[262144]{{0}} parameter(0)
  %p1 = bf16[1048576]{{0}} parameter(1)
  %ag = bf16[1048576]{{0}} all-gather(%p0), channel_id=1, {GROUP}, dimensions={{0}}
  ROOT %cc = bf16[1048576]{{0}} custom-call(%p0, %p1, %ag), custom_call_target="AsyncCollectiveDone"
}}

%wrapped_rs (p: f32[1048576]) -> f32[262144] {{
  %p = f32[1048576]{{0}} parameter(0)
  ROOT %rs = f32[262144]{{0}} reduce-scatter(%p), channel_id=2, {GROUP}, dimensions={{0}}, to_apply=%add
}}

%matmul (x: f32[512,1024], w: f32[1024,1024]) -> f32[512,1024] {{
  %x = f32[512,1024]{{1,0}} parameter(0)
  %w = f32[1024,1024]{{1,0}} parameter(1)
  ROOT %d = f32[512,1024]{{1,0}} dot(%x, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%cond (p: (s32[], (bf16[262144], bf16[1048576]))) -> pred[] {{
  %p = (s32[], (bf16[262144]{{0}}, bf16[1048576]{{0}})) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}}

%body (p: (s32[], (bf16[262144], bf16[1048576]))) -> (s32[], (bf16[262144], bf16[1048576])) {{
  %p = (s32[], (bf16[262144]{{0}}, bf16[1048576]{{0}})) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %prev = (bf16[262144]{{0}}, bf16[1048576]{{0}}) get-tuple-element(%p), index=1
  %got = bf16[1048576]{{0}} all-gather-done(%prev)
  %src = bf16[262144]{{0}} slice(%got), slice={{[0:262144]}}
  %next = (bf16[262144]{{0}}, bf16[1048576]{{0}}) all-gather-start(%src), channel_id=4, {GROUP}, dimensions={{0}}
  %x = f32[512,1024]{{1,0}} broadcast(%got), dimensions={{}}
  %w = f32[1024,1024]{{1,0}} broadcast(%got), dimensions={{}}
  %y = f32[512,1024]{{1,0}} fusion(%x, %w), kind=kOutput, calls=%matmul
  ROOT %t = (s32[], (bf16[262144]{{0}}, bf16[1048576]{{0}})) tuple(%i, %next)
}}

%plain (q: (s32[], f32[256,1024], f32[1024,1024])) -> (s32[], f32[256,1024], f32[1024,1024]) {{
  %q = (s32[], f32[256,1024]{{1,0}}, f32[1024,1024]{{1,0}}) parameter(0)
  %x = f32[256,1024]{{1,0}} get-tuple-element(%q), index=1
  %w = f32[1024,1024]{{1,0}} get-tuple-element(%q), index=2
  %d = f32[256,1024]{{1,0}} dot(%x, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  ROOT %t = (s32[], f32[256,1024]{{1,0}}, f32[1024,1024]{{1,0}}) tuple(%x, %d, %w)
}}

ENTRY %main (a: bf16[1048576], m: f32[1024,1024], l: f32[2048,1024]) -> f32[65536] {{
  %a = bf16[1048576]{{0}} parameter(0)
  %m = f32[1024,1024]{{1,0}} parameter(1)
  %l = f32[2048,1024]{{1,0}} parameter(2)
  %ag1 = (bf16[1048576]{{0}}, bf16[4194304]{{0}}) all-gather-start(%a), channel_id=5, {GROUP}, dimensions={{0}}
  %d1 = f32[1024,1024]{{1,0}} dot(%m, %m), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %ag1d = bf16[4194304]{{0}} all-gather-done(%ag1)
  %s = bf16[262144]{{0}} slice(%a), slice={{[0:262144]}}
  %pair_a = (bf16[262144]{{0}}, bf16[1048576]{{0}}, u32[]) fusion(%s), kind=kCustom, calls=%tpu_start
  %f = f32[1048576]{{0}} convert(%a)
  %pair_b = ((f32[1048576]{{0}}), f32[262144]{{0}}) async-start(%f), calls=%wrapped_rs
  %d2 = f32[2048,1024]{{1,0}} dot(%l, %m), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %ga = bf16[262144]{{0}} get-tuple-element(%pair_a), index=0
  %gb = bf16[1048576]{{0}} get-tuple-element(%pair_a), index=1
  %pair_a_done = bf16[1048576]{{0}} fusion(%ga, %gb), kind=kCustom, calls=%tpu_done
  %pair_b_done = f32[262144]{{0}} async-done(%pair_b), calls=%wrapped_rs
  %small = f32[65536]{{0}} slice(%f), slice={{[0:65536]}}
  %sync = f32[65536]{{0}} all-reduce(%small), channel_id=6, {GROUP}, to_apply=%add
  %first = (bf16[262144]{{0}}, bf16[1048576]{{0}}) all-gather-start(%s), channel_id=4, {GROUP}, dimensions={{0}}
  %zero = s32[] constant(0)
  %init = (s32[], (bf16[262144]{{0}}, bf16[1048576]{{0}})) tuple(%zero, %first)
  %loop = (s32[], (bf16[262144]{{0}}, bf16[1048576]{{0}})) while(%init), condition=%cond, body=%body
  %last = (bf16[262144]{{0}}, bf16[1048576]{{0}}) get-tuple-element(%loop), index=1
  %lastd = bf16[1048576]{{0}} all-gather-done(%last)
  %x5 = f32[256,1024]{{1,0}} slice(%l), slice={{[0:256], [0:1024]}}
  %init5 = (s32[], f32[256,1024]{{1,0}}, f32[1024,1024]{{1,0}}) tuple(%zero, %x5, %m)
  %loop5 = (s32[], f32[256,1024]{{1,0}}, f32[1024,1024]{{1,0}}) while(%init5), condition=%cond, body=%plain, backend_config={{"known_trip_count":{{"n":"5"}}}}
  ROOT %out = f32[65536]{{0}} copy(%sync)
}}
"""


def test_exposed_communication_of_a_hand_built_schedule():
  """Per device, groups of 4 on one ICI link: every transfer and dot worked out by hand.
  - an all-gather to bf16[4M] (sends 8 MiB x 3/4) over a 1024^3 dot: the rest exposed;
  - TPU's fused start/done of an all-gather to bf16[1M] and XLA's async reduce-scatter
    to f32[256k] (1 MiB x 3) in flight together over one 2048x1024x1024 dot: they queue
    on the link, so their sum less the dot is exposed (either alone would hide);
  - a synchronous all-reduce of f32[64k] (2 x 256 KiB x 3/4): all exposed;
  - a 3-trip loop whose body waits for the all-gather started before it (or in the
    previous trip), starts the next and does a 512x1024x1024 dot: the first wait is
    whole, the three after it (the last after the loop) wait for the gather less a dot;
  - a 5-trip loop of 256x1024x1024 dots and no collective: compute only."""
  t = lambda nbytes: nbytes / ICI
  c = lambda m, k, n: 2 * m * k * n / PEAK
  ag1, c1 = t(8 * 2**20 * 3 / 4), c(1024, 1024, 1024)
  pair, c2 = t(2 * 2**20 * 3 / 4) + t(2**20 * 3), c(2048, 1024, 1024)
  sync = t(2 * 2**18 * 3 / 4)
  piped, c4 = t(2 * 2**20 * 3 / 4), c(512, 1024, 1024)
  compute = c1 + c2 + 3 * c4 + 5 * c(256, 1024, 1024)
  comm = ag1 + pair + sync + 4 * piped
  exposed = (ag1 - c1) + (pair - c2) + sync + piped + 3 * (piped - c4)
  assert min(ag1 - c1, pair - c2, piped - c4) > 0 and max(t(2**20 * 3), t(1.5 * 2**20)) < c2
  got = overlap.exposed(HLO, {"data": 4}, "v5e")
  assert got["unknown"] == [] and got["asynchronous"] == 7  # 1 + 2 + 1 + 3 in the loop
  assert got["compute_s"] == pytest.approx(compute, rel=1e-9)
  assert got["comm_s"] == pytest.approx(comm, rel=1e-9)
  assert got["exposed_s"] == pytest.approx(exposed, rel=1e-9)
  assert got["step_s"] == pytest.approx(compute + exposed, rel=1e-9)
  assert got["share"] == pytest.approx(exposed / (compute + exposed), rel=1e-9)
  assert got["serial_share"] == pytest.approx(comm / (compute + comm), rel=1e-9)
  line = overlap.describe(got)
  assert line.startswith(f"exposed communication: {got['share']:.1%} of the step "
                         f"({got['serial_share']:.1%} if nothing overlapped;")


def test_a_collective_in_a_loop_of_unknown_trip_count_is_reported_not_counted_once():
  """The loop's condition compares with a carried bound, not a constant: the estimate
  names the loop instead of counting its collective once."""
  hlo = HLO.replace("%n = s32[] constant(3)", "%n = s32[] get-tuple-element(%p), index=0")
  got = overlap.exposed(hlo, {"data": 4}, "v5e")
  assert got["unknown"] == ["loop"]
  assert overlap.describe(got) == ("exposed communication: unknown (collectives in loops "
                                   "whose trip count cannot be read: loop)")


SPARSECORE = f"""HloModule sparsecore, is_scheduled=true

%sc_gather (p0: bf16[262144], p1: token[]) -> bf16[1048576] {{
  %p1 = token[] parameter(1)
  %p0 = bf16[262144]{{0}} parameter(0)
  ROOT %ag = bf16[1048576]{{0}} all-gather(%p0), channel_id=7, {GROUP}, dimensions={{0}}
}}, execution_thread="sparsecore"

ENTRY %main (a: bf16[262144], x: f32[512,1024], m: f32[1024,1024]) -> bf16[1048576] {{
  %a = bf16[262144]{{0}} parameter(0)
  %x = f32[512,1024]{{1,0}} parameter(1)
  %m = f32[1024,1024]{{1,0}} parameter(2)
  %tok = token[] after-all()
  %g1 = ((bf16[262144]{{0}}, token[]), bf16[1048576]{{0}}) call-start(%a, %tok), async_execution_thread="sparsecore", to_apply=%sc_gather
  %d = f32[512,1024]{{1,0}} dot(%x, %m), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %g1d = bf16[1048576]{{0}} call-done(%g1)
  %g2 = ((bf16[262144]{{0}}, token[]), bf16[1048576]{{0}}) call-start(%a, %tok), async_execution_thread="sparsecore", to_apply=%sc_gather
  %g2d = bf16[1048576]{{0}} call-done(%g2)
  ROOT %out = bf16[1048576]{{0}} add(%g1d, %g2d)
}}
"""


def test_gathers_offloaded_to_the_sparsecores_are_asynchronous():
  """v5p/v6e under `--tpu_flags=auto`: an all-gather runs on the SparseCores as an async
  `call-start`/`call-done` of a computation holding it. The first is half hidden by a
  512x1024x1024 dot; the second has nothing between its start and done: all exposed."""
  gather, dot = 2 * 2**20 * 3 / 4 / ICI, 2 * 512 * 1024 * 1024 / PEAK
  assert 0 < dot < gather
  got = overlap.exposed(SPARSECORE, {"data": 4}, "v5e")
  assert got["asynchronous"] == 2 and got["bytes"] == 2 * 2 * 2**20 * 3 / 4
  assert got["compute_s"] == pytest.approx(dot, rel=1e-9)
  assert got["exposed_s"] == pytest.approx(2 * gather - dot, rel=1e-9)
