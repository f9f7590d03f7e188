"""The stream-level check for parameters read after their in-place write."""
from pockjax.export.hazard import find_hazards

STREAM = """
  util.func public @train_step(%arg0: !hal.buffer_view) -> !hal.buffer_view {
    %g3 = util.global.load @g3 : !stream.resource<variable>
    %w = util.global.load immutable @frozen : !stream.resource<constant>
    %5 = stream.cmd.execute on(#hal.device.affinity<@__device_0>) with(%g3 as %arg2: !stream.resource<variable>{%c64}, %w as %arg3: !stream.resource<constant>{%c64}, %t as %arg4: !stream.resource<transient>{%c64}) {
      stream.cmd.dispatch @d::@forward(%c0 : i32) {
        ro %arg2[%c0 for %c64] : !stream.resource<variable>{%c64},
        ro %arg3[%c0 for %c64] : !stream.resource<constant>{%c64},
        wo %arg4[%c0 for %c64] : !stream.resource<transient>{%c64}
      }
      stream.cmd.dispatch @d::@update(%c0 : i32) {
        ro %arg4[%c0 for %c64] : !stream.resource<transient>{%c64},
        rw %arg2[%c0 for %c64] : !stream.resource<variable>{%c64}
      }
      stream.cmd.dispatch @d::@backward(%c0 : i32) {
        ro %arg2[%c0 for %c64] : !stream.resource<variable>{%c64},
        wo %arg4[%c0 for %c64] : !stream.resource<transient>{%c64}
      }
    } => !stream.timepoint
    util.return %arg0 : !hal.buffer_view
  }
"""


def test_a_read_after_the_in_place_update_is_reported():
    hazards = find_hazards(STREAM, {"g3": "params/l1/w"})
    assert len(hazards) == 1
    assert "'params/l1/w'" in hazards[0] and "@d::@backward" in hazards[0]
    assert "@d::@update" in hazards[0]


def test_reads_before_the_update_are_fine():
    safe = STREAM.replace("@d::@backward", "@d::@x").replace(
        "      stream.cmd.dispatch @d::@update", "      stream.cmd.dispatch @d::@late_update")
    lines = safe.splitlines()
    # move the update block (4 lines) after the backward block
    i = next(k for k, l in enumerate(lines) if "@late_update" in l)
    block = lines[i:i + 4]
    del lines[i:i + 4]
    j = next(k for k, l in enumerate(lines) if "} => !stream.timepoint" in l)
    lines[j:j] = block
    assert find_hazards("\n".join(lines), {"g3": "params/l1/w"}) == []
