"""probe_cublas_programmatic.py's SASS summary of an Nsight Compute source-page dump (CPU)."""

import pytest


@pytest.fixture(scope="module")
def probe(load_experiment):
    return load_experiment("probe_cublas_programmatic")


DUMP = """==PROF== Profiling "nvjet_sm90_tst_64x16_64x16_2x4_h_bz_TNT": 0%....50%....100% - 5 passes
Kernel Name        nvjet_sm90_tst_64x16_64x16_2x4_h_bz_TNT
Address            Source                     Warp S
0x7f85f57a3200           LDC R1, c[0x0][0x28]      0
0x7f85f57a3210           S2R R2, SR_TID.X          0
0x7f85f57a3220           EXIT                      0
Kernel Name        delayed_copy_kernel
0x7f85f57a4000           ACQBULK                   3
0x7f85f57a4010           PREEXIT                   0
0x7f85f57a4020     @P0   BRA 0x7f85f57a4000        0
0x7f85f57a4030           EXIT                      0
Kernel Name        nvjet_sm90_tst_64x16_64x16_2x4_h_bz_TNT
0x7f85f57a3200           LDC R1, c[0x0][0x28]      0
"""


def test_sass_rows_count_each_kernels_instructions_once(probe, tmp_path):
    path = tmp_path / "sass.txt"
    path.write_text(DUMP)
    rows = probe.sass_rows(str(path))
    assert rows == [
        dict(kernel="delayed_copy_kernel", sass_instructions=4, griddepcontrol_wait=1, launch_dependents=1),
        dict(kernel="nvjet_sm90_tst_64x16_64x16_2x4_h_bz_TNT", sass_instructions=3, griddepcontrol_wait=0,
             launch_dependents=0),
    ]
