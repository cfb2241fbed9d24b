"""scripts/sass_loops.py on a hand-written SASS listing: loop discovery, counted trip counts, the
fewest- and most-work paths through the main loop and the issue ceiling."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import sass_loops  # noqa: E402

# An outer loop (0x10-0xb0) around a counted inner loop of 4 trips (0x20-0x50) with one MMA each,
# and two FMULs a predicated branch may skip.
LISTING = """
	code for sm_70
		Function : kernel
        /*0000*/                   MOV R0, RZ ;
        /*0010*/                   MOV R1, RZ ;
        /*0020*/                   HMMA.884.F32.F32.STEP0 R4, R8.reuse.ROW, R10.reuse.COL, R4 ;
        /*0030*/                   IADD3 R2, R2, 0x4, RZ ;
        /*0040*/                   ISETP.GE.AND P0, PT, R2, 0x10, PT ;
        /*0050*/              @!P0 BRA 0x20 ;
        /*0060*/               @P1 BRA 0x90 ;
        /*0070*/                   FMUL R3, R3, R3 ;
        /*0080*/                   FMUL R3, R3, R3 ;
        /*0090*/                   IADD3 R0, R0, 0x1, RZ ;
        /*00a0*/                   ISETP.NE.AND P2, PT, R0, R5, PT ;
        /*00b0*/               @P2 BRA 0x10 ;
        /*00c0*/                   EXIT ;
"""


def test_main_loop_counts():
    code = sass_loops.parse_functions(LISTING)["kernel"]
    loops = sass_loops.loops_of(code)
    assert [(lp.start, lp.end, lp.trips) for lp in loops] == [(0x20, 0x50, 4), (0x10, 0xB0, None)]
    outer = loops[1]
    fewest, _ = sass_loops.weighted_mix(code, outer, loops, "HMMA.884", fewest=True)
    most, _ = sass_loops.weighted_mix(code, outer, loops, "HMMA.884", fewest=False)
    # MOV + 4 x (HMMA, IADD3, ISETP, BRA) + BRA + IADD3, ISETP, BRA; the most adds the FMULs.
    assert fewest["mma"] == most["mma"] == 4
    assert sum(fewest.values()) == 21 and sum(most.values()) == 23
    assert most["fp"] == 2 and fewest["fp"] == 0
    text = sass_loops.report("kernel", code, "sm_70")
    assert "main loop 0x10-0xb0" in text
    assert "4 MMA; 5.25-5.75 instructions per MMA" in text
    assert "issue ceiling 35-38%" in text


def test_command_line_reads_a_listing(tmp_path):
    listing = tmp_path / "kernel.sass"
    listing.write_text(LISTING)
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "sass_loops.py"), "--sass",
                          str(listing)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "4 MMA" in run.stdout
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "sass_loops.py"), "--sass",
                          str(listing), "--kernel", "nothing"], capture_output=True, text=True)
    assert run.returncode == 1


# The same loop shape with shared-memory traffic: an LDS.64 per inner trip (2 wavefronts each) and
# an STS.128 (4) per outer iteration that the predicated branch may skip.
SMEM_LISTING = """
	code for sm_70
		Function : kernel
        /*0000*/                   MOV R0, RZ ;
        /*0010*/                   MOV R1, RZ ;
        /*0020*/                   LDS.U.64 R8, [R6] ;
        /*0030*/                   HMMA.884.F32.F32.STEP0 R4, R8.reuse.ROW, R10.reuse.COL, R4 ;
        /*0040*/                   IADD3 R2, R2, 0x4, RZ ;
        /*0050*/                   ISETP.GE.AND P0, PT, R2, 0x10, PT ;
        /*0060*/              @!P0 BRA 0x20 ;
        /*0070*/               @P1 BRA 0x90 ;
        /*0080*/                   STS.128 [R7], R12 ;
        /*0090*/                   IADD3 R0, R0, 0x1, RZ ;
        /*00a0*/                   ISETP.NE.AND P2, PT, R0, R5, PT ;
        /*00b0*/               @P2 BRA 0x10 ;
        /*00c0*/                   EXIT ;
"""


def test_shared_memory_wavefronts_and_ceiling():
    assert [sass_loops.smem_wavefronts(op) for op in
            ("LDS.U", "LDS.U.64", "LDS.U.128", "STS", "STS.64", "STS.128", "LDSM.16.M88.4",
             "LDSM.16.MT88.2", "LDSM.16.M88", "LDG.E.128", "HMMA.884.F32.F32.STEP0")] == \
        [1, 2, 4, 1, 2, 4, 4, 2, 1, 0, 0]
    code = sass_loops.parse_functions(SMEM_LISTING)["kernel"]
    loops = sass_loops.loops_of(code)
    fewest, _ = sass_loops.weighted_mix(code, loops[1], loops, "HMMA.884", fewest=True)
    most, _ = sass_loops.weighted_mix(code, loops[1], loops, "HMMA.884", fewest=False)
    # 4 LDS.64 (8 wavefronts); the most-work path adds the STS.128 (4). Wavefronts are not
    # instructions: 4 x 5 + 5 and one more.
    assert (fewest[sass_loops.WAVEFRONTS], most[sass_loops.WAVEFRONTS]) == (8, 12)
    assert (sass_loops.instructions(fewest), sass_loops.instructions(most)) == (25, 26)
    text = sass_loops.report("kernel", code, "sm_70")
    # 4 MMA x 2 cycles against 4 schedulers x 12 (8) wavefronts: 17-25%.
    assert "shared memory: 8-12 wavefronts, 2.00-3.00 per MMA" in text
    assert "shared-memory ceiling 17-25% of the tensor pipe" in text
