"""The bench's kernel-timing helpers that need no GPU: PTX load counts and cold-weight copy counts."""

from __future__ import annotations

from ds4d.bench.kernels import COLD_BYTES, cold_copies, global_loads

PTX = """
    ld.global.b64 %rd9, [%rd8+0];
    @%p1 ld.global.nc.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
    @%p2 ld.global.L1::evict_last.v4.b32 { %r5, %r6, %r7, %r8 }, [ %rd2 + 0 ];
    ld.global.b8 %rs1, [%rd3];
    ld.shared.v4.b32 { %r9, %r10, %r11, %r12 }, [%r13];
    st.global.b16 [%rd4], %rs2;
    // ld.global.b8 in a comment is not a load
"""


def test_global_loads_counts_each_width_and_ignores_other_memory():
    assert global_loads(PTX) == {"b64": 1, "v4.b32": 2, "b8": 1}


def test_cold_copies_exceed_the_cold_bytes():
    assert cold_copies(4 << 20) * (4 << 20) >= COLD_BYTES  # a 4 MB projection: 64 copies
    assert cold_copies(4 << 20) == COLD_BYTES // (4 << 20)
    assert cold_copies(COLD_BYTES * 3) == 2  # larger than the whole: still two, so calls alternate
