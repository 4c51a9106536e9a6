"""``ds4d.bench.trace_layers`` splits a profiled decode step's trace into layers at every second
hyper-connection boundary and sums each layer's kernels by kind."""

from __future__ import annotations

from ds4d.bench.trace_layers import layers, read, table

LAYER = [("boundary_mixes_kernel", 4.0), ("boundary_collapse_kernel", 6.0), ("fp8_rows_kernel", 13.0),
         ("triton_poi_fused_rope_0", 1.5), ("nvjet_sm90_tst_64x8", 25.0), ("boundary_mixes_kernel", 3.5),
         ("boundary_collapse_kernel", 6.0), ("rows_kernel", 3.0), ("mxfp4_rows_kernel", 27.5),
         ("triton_poi_fused_big_1", 6.0)]


def _trace(tmp_path, rows):
    lines = ["start_us\ttime_us\tgap_us\tname"] + [f"{i}.0\t{t}\t0.5\t{name}" for i, (name, t) in enumerate(rows)]
    path = tmp_path / "trace.graphs.tsv"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_trace_splits_into_layers_summed_by_kind(tmp_path):
    rows = [("Memcpy HtoD (Pinned -> Device)", 0.8), ("embedding_gather", 2.0)] + LAYER + LAYER + \
        [("nvjet_sm90_tss_384x8", 350.0)]
    first, last = layers(read(_trace(tmp_path, rows)))
    assert first.kernels == len(LAYER) and last.kernels == len(LAYER) + 1  # the embedding left out, the head last
    assert first.time_us == sum(t for _, t in LAYER) and first.gaps_us == 0.5 * len(LAYER)
    assert first.kinds == {"hyper-connection boundary": 19.5, "FP8 GEMV": 13.0, "other, each under 2.2 us": 1.5,
                           "cuBLAS": 25.0, "float32 rows GEMV": 3.0, "MXFP4 GEMV": 27.5,
                           "other: triton_poi_fused_big_1": 6.0}
    assert last.kinds["cuBLAS"] == 375.0
    text = table([first, last])
    assert "layer 1 (+ head)" in text and "| cuBLAS | 25.0 | 375.0 |" in text


def test_a_trace_without_the_boundary_kernels_is_one_segment(tmp_path):
    rows = [(name, t) for name, t in LAYER if not name.startswith("boundary")]
    (whole,) = layers(read(_trace(tmp_path, rows)))
    assert whole.kernels == len(rows) and whole.time_us == sum(t for _, t in rows)
