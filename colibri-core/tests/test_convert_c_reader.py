"""The C runtime reads what coli convert writes: qcontainer.c + quant.c against the Python reader, bit for bit.

A small harness (compiled here with the shared runtime) opens a converted container, prints its verdict, each
expert's byte span, and every dequantized row of a few tensors as float32 bit patterns; Python checks them
against ``open_container`` and ``schemes.dequantize``. Tampered stamps must be refused by C as by Python.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib adds no test dir
from test_convert import _rewrite_metadata, run_convert, write_tiny

HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "qcontainer.h"

int main(int argc, char **argv) {
    char err[512];
    cb_st_index idx;
    if (cb_st_open(&idx, argv[1], err, sizeof err)) { printf("open-error %s\n", err); return 0; }
    cb_qcontainer c;
    int rc = cb_qc_open(&c, &idx, err, sizeof err);
    if (rc < 0) { printf("refused %s\n", err); cb_st_close(&idx); return 0; }
    if (rc == 1) { printf("native\n"); cb_st_close(&idx); return 0; }
    printf("container %d\n", c.n);
    for (int a = 2; a < argc; a++) {
        if (strncmp(argv[a], "span:", 5) == 0) {
            const char *names[3];
            char buf[3][512];
            for (int m = 0; m < 3; m++) {
                static const char *w[3] = {"gate", "up", "down"};
                snprintf(buf[m], sizeof buf[m], "%s.%s_proj.weight", argv[a] + 5, w[m]);
                names[m] = buf[m];
            }
            int shard; uint64_t b, e;
            if (cb_qc_span(&c, names, 3, &shard, &b, &e, err, sizeof err)) printf("span-error %s\n", err);
            else printf("span %s %llu %llu\n", idx.shard_paths[shard], (unsigned long long)b, (unsigned long long)e);
            continue;
        }
        const cb_qc_entry *e = cb_qc_find(&c, argv[a]);
        if (!e || !e->qweight) { printf("missing %s\n", argv[a]); continue; }
        void *q = cb_st_load(&idx, e->qweight, err, sizeof err), *s = cb_st_load(&idx, e->scales, err, sizeof err);
        cb_qmatrix W;
        if (!q || !s || cb_qc_matrix(e, q, s, &W)) { printf("load-error %s\n", err); return 1; }
        float *row = malloc(sizeof(float) * (size_t)W.cols);
        printf("rows %s %d %d\n", argv[a], W.rows, W.cols);
        for (int r = 0; r < W.rows; r++) {
            cb_qdequant_row(row, &W, r);
            for (int k = 0; k < W.cols; k++) { uint32_t u; memcpy(&u, &row[k], 4); printf("%08x", u); }
            printf("\n");
        }
        free(row); free(q); free(s);
    }
    cb_qc_close(&c);
    cb_st_close(&idx);
    return 0;
}
"""

EXPERT = "model.layers.1.mlp.experts.5"
NAMES = [f"{EXPERT}.gate_proj.weight", f"{EXPERT}.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"]


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    from colibri.builder import RUNTIME_DIR, runtime_sources
    from colibri.compiler import CFLAGS, LDLIBS, find_compiler

    compiler = find_compiler()   # the suite needs a C compiler (.ci/run installs one): no compiler is a failure
    d = tmp_path_factory.mktemp("harness")
    (d / "harness.c").write_text(HARNESS)
    exe = d / "harness"
    # Only what the reader needs, so an unrelated engine source being edited cannot break this test.
    wanted = {"json.c", "safetensors.c", "threads.c", "qcontainer.c"}
    sources = [p for p in runtime_sources() if p.name in wanted or p.name.startswith(("kernels", "quant"))]
    cmd = [*compiler.argv, *CFLAGS, f"-I{RUNTIME_DIR}", str(d / "harness.c"), *map(str, sources),
           "-o", str(exe), *LDLIBS]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return exe


@pytest.fixture(scope="module")
def container(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("creader")
    src = write_tiny(root / "src")
    out = root / "out"
    run_convert(src, out, experts="int4", dense="int8")
    return out


def _run(harness: Path, directory: Path, *args: str) -> list[str]:
    proc = subprocess.run([str(harness), str(directory), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_c_reader_matches_python(harness, container):
    from colibri.convert.container import open_container
    from colibri.convert.schemes import QUANT_SCHEMES, dequantize

    py = open_container(container)
    lines = _run(harness, container, f"span:{EXPERT}", *NAMES)
    assert lines[0] == f"container {len(py.tensors)}"
    file, begin, end = py.extent(tuple(f"{EXPERT}.{w}_proj.weight" for w in ("gate", "up", "down")))
    assert lines[1] == f"span {file} {begin} {end}"
    rows_at = [i for i, ln in enumerate(lines) if ln.startswith("rows ")]
    assert len(rows_at) == len(NAMES)
    for i in rows_at:
        _, name, rows, cols = lines[i].split()
        st = py.tensors[name]
        qw, sc = st.parts
        with open(qw.file, "rb") as fh:
            fh.seek(qw.begin)
            q = np.frombuffer(fh.read(qw.nbytes), dtype=np.int8 if qw.dtype == "I8" else np.uint8).reshape(qw.shape)
            fh.seek(sc.begin)
            s = np.frombuffer(fh.read(sc.nbytes), dtype="<f2").reshape(sc.shape)
        want = dequantize(QUANT_SCHEMES[st.scheme], q, s).astype(np.float32)        # exact in float32
        got = np.array([[int(ln[k:k + 8], 16) for k in range(0, len(ln), 8)] for ln in lines[i + 1:i + 1 + int(rows)]],
                       dtype=np.uint32).view(np.float32)
        assert (int(rows), int(cols)) == st.shape
        np.testing.assert_array_equal(got, want)


def test_c_reader_native_and_refusals(harness, container, tmp_path):
    src = write_tiny(tmp_path / "native", layers=1)
    assert _run(harness, src) == ["native"]
    cases = [
        ({"colibri_version": "2"}, "colibri-quant version 2 is not supported"),
        ({"colibri_container": "other"}, "is not a format colibri knows"),
        ({"colibri_schemes": json.dumps({})}, "is not named in the colibri.schemes map"),
        ({"colibri_schemes": "[1]"}, "is not a JSON object"),
        ({"colibri_container": None, "colibri_version": None, "colibri_schemes": None}, "has no colibri-quant stamp"),
    ]
    for i, (changes, needle) in enumerate(cases):
        bad = shutil.copytree(container, tmp_path / f"bad{i}")
        _rewrite_metadata(bad / "model-00002-of-00003.safetensors", **changes)
        (line,) = _run(harness, bad)
        assert line.startswith("refused ") and needle in line, line
