"""libnrt runtime against a FAKE libnrt built from C at test time: our ctypes prototypes,
tensor-set binding by name, status codes as exceptions, and DP8 replicas on 8 cores running
truly in parallel (the GIL released around nrt_execute)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest

from polyaccel.neuron import nrt, runtime

FAKE_LIBNRT_C = r"""
/* A stand-in for libnrt.so.1 with the signatures polyaccel declares. A "NEFF" is the text
   "FAKE <n> <sleep_ms> [<dtype code> [<size> [<ndim>]]]": one input "input0" and one output
   "output0" of n elements (float32, n*4 bytes and rank 1 unless given); execute sleeps sleep_ms, writes
   output = 2 * input and counts executions per core.
   Handles are never freed, only marked dead, so that any later use of one (after its free,
   or after nrt_close) is counted in fake_misuse() instead of crashing; fake_fail() makes the
   next call(s) of a function return a status. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define LIVE 0x11FE
#define DEAD 0xDEAD
typedef struct { char name[256]; int usage; size_t size; int dtype; uint32_t *shape; uint32_t ndim; } info_t;
typedef struct { uint64_t count; info_t entries[]; } info_array_t;
typedef struct { int magic; int core; int n; int sleep_ms; int dtype; size_t size; unsigned ndim; uint32_t shape[1]; } model_t;
typedef struct { int magic; int core; size_t size; char name[256]; char *data; } tensor_t;
typedef struct { int magic; int n; char names[16][256]; tensor_t *t[16]; } tset_t;

static int initialized = 0;
static int exec_count[64];
static int live_tensors = 0, live_models = 0, live_sets = 0, live_infos = 0;
static int misuse = 0, closed_with_live = 0, close_calls = 0, executing = 0;
static int last_nc_count = 0;
static int load_log[4096];
static int load_n = 0;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct { char call[64]; int status; int skip; } faults[4];

#define BUMP(v, d) __atomic_add_fetch(&(v), (d), __ATOMIC_SEQ_CST)
#define GET(v) __atomic_load_n(&(v), __ATOMIC_SEQ_CST)

int fake_fail(const char *call, int status, int skip) {
    pthread_mutex_lock(&mu);
    for (int i = 0; i < 4; i++) if (!faults[i].call[0]) {
        snprintf(faults[i].call, 64, "%s", call); faults[i].status = status; faults[i].skip = skip;
        pthread_mutex_unlock(&mu); return 0;
    }
    pthread_mutex_unlock(&mu); return -1;
}
void fake_clear_faults(void) { pthread_mutex_lock(&mu); memset(faults, 0, sizeof faults); pthread_mutex_unlock(&mu); }
static int injected(const char *call) {
    int status = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < 4; i++) if (faults[i].call[0] && strcmp(faults[i].call, call) == 0) {
        if (faults[i].skip-- > 0) break;
        status = faults[i].status; faults[i].call[0] = 0; break;
    }
    pthread_mutex_unlock(&mu);
    return status;
}
/* a handle that is dead, or any handle used while the runtime is closed, is misuse */
static int bad(int magic) { if (magic != LIVE || !GET(initialized)) { BUMP(misuse, 1); return 1; } return 0; }

int fake_exec_count(int core) { return GET(exec_count[core]); }
int fake_live_tensors(void) { return GET(live_tensors); }
int fake_live_models(void) { return GET(live_models); }
int fake_live_sets(void) { return GET(live_sets); }
int fake_live_infos(void) { return GET(live_infos); }
int fake_misuse(void) { return GET(misuse); }
int fake_closed_with_live(void) { return GET(closed_with_live); }
int fake_close_calls(void) { return GET(close_calls); }
int fake_executing(void) { return GET(executing); }
int fake_last_nc_count(void) { return last_nc_count; }
int fake_load_count(void) { return GET(load_n); }
int fake_loaded_core(int i) { return load_log[i]; }  /* start_nc of the i-th nrt_load call */

int nrt_init(int framework, const char *fw, const char *fal) { __atomic_store_n(&initialized, 1, __ATOMIC_SEQ_CST); return 0; }
void nrt_close(void) {
    BUMP(close_calls, 1);
    BUMP(closed_with_live, GET(live_models) + GET(live_tensors) + GET(live_sets));
    __atomic_store_n(&initialized, 0, __ATOMIC_SEQ_CST);
}

int nrt_load(const void *neff, size_t size, int32_t start_nc, int32_t nc_count, model_t **model) {
    if (!GET(initialized)) return 13;
    last_nc_count = nc_count;
    int slot = BUMP(load_n, 1) - 1;
    if (slot < 4096) load_log[slot] = start_nc;
    int rc = injected("nrt_load");
    if (rc) return rc;
    if (size < 4 || memcmp(neff, "FAKE", 4) != 0) return 10;
    if (start_nc > 7) return 9;
    char buf[64] = {0};
    memcpy(buf, neff, size < 63 ? size : 63);
    model_t *m = calloc(1, sizeof(model_t));
    m->core = start_nc < 0 ? 0 : start_nc;
    m->dtype = 0xA; m->size = 0; m->ndim = 1;
    int got = sscanf(buf, "FAKE %d %d %i %zu %u", &m->n, &m->sleep_ms, &m->dtype, &m->size, &m->ndim);
    if (got < 2) { free(m); return 2; }
    if (got < 4) m->size = (size_t)m->n * 4;
    if (got < 5) m->ndim = 1;
    m->shape[0] = (uint32_t)m->n;
    m->magic = LIVE;
    BUMP(live_models, 1);
    *model = m;
    return 0;
}
int nrt_unload(model_t *m) {
    if (bad(m->magic)) return 3;
    int rc = injected("nrt_unload");
    m->magic = DEAD; BUMP(live_models, -1);
    return rc;
}

int nrt_get_model_tensor_info(model_t *m, info_array_t **out) {
    if (bad(m->magic)) return 3;
    int rc = injected("nrt_get_model_tensor_info");
    if (rc) return rc;
    info_array_t *a = calloc(1, sizeof(info_array_t) + 2 * sizeof(info_t));
    a->count = 2;
    for (int i = 0; i < 2; i++) {
        snprintf(a->entries[i].name, 256, i == 0 ? "input0" : "output0");
        a->entries[i].usage = i; a->entries[i].size = m->size; a->entries[i].dtype = m->dtype;
        a->entries[i].shape = m->shape; a->entries[i].ndim = m->ndim;
    }
    BUMP(live_infos, 1);
    *out = a;
    return 0;
}
int nrt_free_model_tensor_info(info_array_t *a) { free(a); BUMP(live_infos, -1); return 0; }

int nrt_tensor_allocate(int placement, int core, size_t size, const char *name, tensor_t **out) {
    if (!GET(initialized)) { BUMP(misuse, 1); return 13; }
    int rc = injected("nrt_tensor_allocate");
    if (rc) return rc;
    tensor_t *t = calloc(1, sizeof(tensor_t));
    t->core = core; t->size = size; snprintf(t->name, 256, "%s", name); t->data = calloc(1, size);
    t->magic = LIVE;
    BUMP(live_tensors, 1);
    *out = t;
    return 0;
}
void nrt_tensor_free(tensor_t **t) {
    if (!*t) return;
    if (bad((*t)->magic)) return;
    (*t)->magic = DEAD; *t = NULL; BUMP(live_tensors, -1);
}
int nrt_tensor_write(tensor_t *t, const void *buf, size_t off, size_t size) {
    if (bad(t->magic)) return 3;
    if (off + size > t->size) return 1006;
    memcpy(t->data + off, buf, size); return 0;
}
int nrt_tensor_read(const tensor_t *t, void *buf, size_t off, size_t size) {
    if (bad(t->magic)) return 3;
    if (off + size > t->size) return 1006;
    memcpy(buf, t->data + off, size); return 0;
}
int nrt_allocate_tensor_set(tset_t **out) {
    int rc = injected("nrt_allocate_tensor_set");
    if (rc) return rc;
    tset_t *s = calloc(1, sizeof(tset_t)); s->magic = LIVE; BUMP(live_sets, 1);
    *out = s; return 0;
}
int nrt_add_tensor_to_tensor_set(tset_t *s, const char *name, tensor_t *t) {
    if (bad(s->magic) || bad(t->magic)) return 3;
    int rc = injected("nrt_add_tensor_to_tensor_set");
    if (rc) return rc;
    if (s->n == 16) return 4;
    snprintf(s->names[s->n], 256, "%s", name); s->t[s->n++] = t; return 0;
}
void nrt_destroy_tensor_set(tset_t **s) {
    if (!*s) return;
    if (bad((*s)->magic)) return;
    (*s)->magic = DEAD; *s = NULL; BUMP(live_sets, -1);
}

static tensor_t *find(const tset_t *s, const char *name) {
    for (int i = 0; i < s->n; i++) if (strcmp(s->names[i], name) == 0) return s->t[i];
    return NULL;
}
int nrt_execute(model_t *m, const tset_t *in, tset_t *out) {
    if (bad(m->magic) || bad(in->magic) || bad(out->magic)) return 3;
    tensor_t *x = find(in, "input0"), *y = find(out, "output0");
    if (!x || !y) return 1002;
    if (x->core != m->core || y->core != m->core) return 2;
    int rc = injected("nrt_execute");
    if (rc) return rc;
    BUMP(executing, 1);
    usleep(m->sleep_ms * 1000);
    /* everything this call uses must still be alive when the device is done with it */
    int gone = bad(m->magic) || bad(in->magic) || bad(out->magic) || bad(x->magic) || bad(y->magic);
    if (!gone) {
        float *xi = (float *)x->data, *yo = (float *)y->data;
        for (int i = 0; i < m->n; i++) yo[i] = 2.0f * xi[i];
        BUMP(exec_count[m->core], 1);
    }
    BUMP(executing, -1);
    return gone ? 3 : 0;
}
"""


@pytest.fixture(scope="module")
def fake_libnrt(tmp_path_factory):
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler (gcc) to build the fake libnrt")
    d = tmp_path_factory.mktemp("fake_nrt")
    (d / "fake_nrt.c").write_text(FAKE_LIBNRT_C)
    so = d / "libnrt.so.1"
    subprocess.run([gcc, "-shared", "-fPIC", "-pthread", "-O1", "-o", str(so), str(d / "fake_nrt.c")], check=True)
    lib = nrt.load(str(so))
    lib.init()
    yield lib
    lib.close()


def test_load_bind_execute_and_free(fake_libnrt):
    model = runtime.NeuronModel(b"FAKE 6 0", core=3, lib=fake_libnrt)
    assert fake_libnrt.lib.fake_last_nc_count() == nrt.VNC_COUNT_AUTO == -1  # nrt.h: deprecated, always -1
    assert [(i.name, i.dtype, i.shape) for i in model.inputs] == [("input0", np.dtype(np.float32), (6,))]
    assert [i.name for i in model.outputs] == ["output0"]
    before = fake_libnrt.lib.fake_exec_count(3)
    x = np.random.default_rng().standard_normal(6).astype(np.float32)
    (y,) = model.execute([x])
    np.testing.assert_array_equal(y, 2 * x)
    (y,) = model({"input0": x + 1})  # by tensor name
    np.testing.assert_array_equal(y, 2 * (x + 1))
    assert fake_libnrt.lib.fake_exec_count(3) == before + 2
    live = fake_libnrt.lib.fake_live_tensors()
    model.close()
    assert fake_libnrt.lib.fake_live_tensors() == live - 2
    with pytest.raises(KeyError):
        runtime.NeuronModel(b"FAKE 2 0", core=0, lib=fake_libnrt).execute({"x": x})


def test_status_codes_become_named_errors(fake_libnrt):
    with pytest.raises(nrt.NrtError) as e:
        runtime.NeuronModel(b"NOTANEFF", core=0, lib=fake_libnrt)
    assert e.value.code == 10 and e.value.status == "NRT_UNSUPPORTED_NEFF_VERSION"
    with pytest.raises(nrt.NrtError) as e:
        runtime.NeuronModel(b"FAKE 4 0", core=9, lib=fake_libnrt)
    assert e.value.status == "NRT_LOAD_NOT_ENOUGH_NC"
    with pytest.raises(ValueError):  # wrong input size is caught before libnrt sees it
        runtime.NeuronModel(b"FAKE 4 0", core=0, lib=fake_libnrt).execute([np.zeros(5, np.float32)])

    # a tensor set that binds the wrong name: the runtime reports NRT_EXEC_BAD_INPUT
    model = runtime.NeuronModel(b"FAKE 4 0", core=1, lib=fake_libnrt)
    bad = ctypes.c_void_p()
    fake_libnrt.check("nrt_allocate_tensor_set", fake_libnrt.lib.nrt_allocate_tensor_set(ctypes.byref(bad)))
    with pytest.raises(nrt.NrtError) as e:
        fake_libnrt.check("nrt_execute", fake_libnrt.lib.nrt_execute(model._model, bad, model._out_set))
    assert e.value.status == "NRT_EXEC_BAD_INPUT" and "nrt_execute" in str(e.value)
    fake_libnrt.lib.nrt_destroy_tensor_set(ctypes.byref(bad))
    model.close()


def test_dp8_replicas_on_8_cores_run_in_parallel(fake_libnrt, tmp_path, monkeypatch):
    """8 replicas, one per NeuronCore, 8 threads, each execute sleeping 50 ms in C: with the
    GIL released the wall time is ~50 ms, not 400."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")  # so that both are restored after the test
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-7")
    fake_libnrt.close()  # libnrt reads the visible cores at nrt_init: the factory restarts it
    env = runtime.configure_lnc1()
    assert env == {"NEURON_LOGICAL_NC_CONFIG": "1", "NEURON_RT_VISIBLE_CORES": "0-7"}
    (tmp_path / "encode.neff").write_bytes(b"FAKE 1024 50")
    factory = runtime.replica_factory({"encode": tmp_path / "encode.neff"}, lib_path=fake_libnrt.path)
    replicas = [factory(i) for i in range(8)]
    assert [r.core for r in replicas] == list(range(8))
    before = [fake_libnrt.lib.fake_exec_count(c) for c in range(8)]
    xs = [np.full(1024, i, np.float32) for i in range(8)]
    results: list = [None] * 8
    barrier = threading.Barrier(8)

    def work(i):
        barrier.wait()
        results[i] = replicas[i].process([[xs[i]]])

    replicas[0].process([[xs[0]]])  # warm-up outside the timing
    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for i in range(8):
        np.testing.assert_array_equal(results[i][0][0], 2 * xs[i])
    after = [fake_libnrt.lib.fake_exec_count(c) for c in range(8)]
    assert [a - b for a, b in zip(after, before)] == [2] + [1] * 7  # each replica ran on its own core
    assert wall < 0.2, f"8 parallel 50 ms executes took {wall * 1e3:.0f} ms (serialized would be 400)"
    for r in replicas:
        r.close()


def test_replica_works_in_core_replica_pool(fake_libnrt, tmp_path, monkeypatch):
    pool_mod = pytest.importorskip("polyaccel.core.runtime")
    if not hasattr(pool_mod, "ReplicaPool"):
        pytest.skip("polyaccel.core.runtime.ReplicaPool is not there yet")
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4-7")
    fake_libnrt.close()  # libnrt reads the visible cores at nrt_init: the factory restarts it
    (tmp_path / "g.neff").write_bytes(b"FAKE 8 1")
    factory = runtime.replica_factory({"g": tmp_path / "g.neff"}, lib_path=fake_libnrt.path)
    items = [[np.full(8, i, np.float32)] for i in range(20)]
    with pool_mod.ReplicaPool(factory, 4, batch_size=3) as pool:
        outs = list(pool.map(items))
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out.unwrap()[0], np.full(8, 2 * i, np.float32))


def test_missing_libnrt_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("NEURON_RT_LIB", "/nonexistent/libnrt.so.1")
    monkeypatch.setattr("polyaccel.neuron.plugin.LIBNRT_PATHS", ())
    monkeypatch.setattr("ctypes.util.find_library", lambda name: None)
    with pytest.raises(OSError, match="libnrt.so.1"):
        nrt.load()


def test_a_missing_neuron_rt_lib_is_not_replaced_by_another_libnrt(tmp_path, monkeypatch):
    from polyaccel.neuron.plugin import find_libnrt

    other = tmp_path / "libnrt.so.1"
    other.write_bytes(b"")
    monkeypatch.setattr("polyaccel.neuron.plugin.LIBNRT_PATHS", (str(other),))
    assert find_libnrt() == str(other)
    monkeypatch.setenv("NEURON_RT_LIB", str(tmp_path / "typo" / "libnrt.so.1"))
    assert find_libnrt() is None
    with pytest.raises(OSError, match="NEURON_RT_LIB=.*typo.* does not exist"):
        nrt.load()


def test_inputs_of_another_shape_or_kind_are_refused(fake_libnrt):
    """Equal byte counts were enough: a [2, 3] array ran as the NEFF's [6], and an input the
    NEFF reads as integers would have taken floats truncated."""
    model = runtime.NeuronModel(b"FAKE 6 0", core=2, lib=fake_libnrt)
    before = fake_libnrt.lib.fake_exec_count(2)
    with pytest.raises(ValueError, match=r"shape \(2, 3\), the NEFF expects \(6,\)"):
        model.execute([np.zeros((2, 3), np.float32)])
    with pytest.raises(TypeError, match="does not convert safely"):
        runtime._input_array(nrt.TensorInfo("ids", nrt.USAGE_INPUT, 24, np.dtype(np.int32), (6,)),
                             np.full(6, 2.7, np.float32))
    assert fake_libnrt.lib.fake_exec_count(2) == before
    (y,) = model.execute([np.arange(6, dtype=np.float64)])  # float64 -> the NEFF's float32 is fine
    np.testing.assert_array_equal(y, 2 * np.arange(6, dtype=np.float32))
    model.close()


def test_a_model_whose_setup_fails_is_unloaded_from_its_core(fake_libnrt, monkeypatch):
    """A failure after nrt_load (here: no tensor set) left the model loaded on its core until the
    half-built object was garbage collected, which the kept exception (a pool stores per-item
    errors) delays: a restarted replica's load on that core met the stale model."""
    unloaded = []
    real_unload = fake_libnrt.lib.nrt_unload

    def unload(model):
        unloaded.append(model)
        return real_unload(model)

    monkeypatch.setattr(fake_libnrt.lib, "nrt_unload", unload)
    monkeypatch.setattr(fake_libnrt.lib, "nrt_allocate_tensor_set", lambda out: 4)
    with pytest.raises(nrt.NrtError, match="NRT_RESOURCE") as kept:
        runtime.NeuronModel(b"FAKE 4 0", core=5, lib=fake_libnrt)
    assert len(unloaded) == 1 and kept.value.status == "NRT_RESOURCE"


@pytest.mark.parametrize("file_mode,dir_mode", [(0o666, 0o755), (0o755, 0o777), (0o775, 0o755)])
def test_a_libnrt_others_can_write_is_not_loaded(fake_libnrt, tmp_path, monkeypatch, file_mode, dir_mode):
    """NEURON_RT_LIB at a library (or in a folder) another user can write, e.g. under /tmp,
    was dlopen'ed: their code ran in our process."""
    d = tmp_path / "lib"
    d.mkdir()
    so = d / "libnrt.so.1"
    shutil.copy(fake_libnrt.path, so)
    so.chmod(file_mode)
    d.chmod(dir_mode)
    monkeypatch.setenv("NEURON_RT_LIB", str(so))
    with pytest.raises(OSError, match="must not be writable by others"):
        nrt.load()
    so.chmod(0o755)
    d.chmod(0o755)
    assert nrt.load().path == str(so)


def test_a_libnrt_another_user_owns_is_not_loaded(fake_libnrt, tmp_path, monkeypatch):
    """Whoever owns the library (or its folder) can rewrite it, whatever its mode."""
    d = tmp_path / "lib"
    d.mkdir()
    so = d / "libnrt.so.1"
    shutil.copy(fake_libnrt.path, so)
    if os.geteuid() == 0:
        os.chown(so, 4242, -1)
    else:
        monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)
    monkeypatch.setenv("NEURON_RT_LIB", str(so))
    with pytest.raises(OSError, match="owned by uid"):
        nrt.load()


def test_the_checked_libnrt_is_loaded_not_a_link_swapped_after_the_check(fake_libnrt, tmp_path, monkeypatch):
    """NEURON_RT_LIB at a link in a folder others can write, to a trusted libnrt: the check
    passed on the link's target, then dlopen followed the link again, which its folder's
    users could have pointed elsewhere in between."""
    trusted, shared = tmp_path / "trusted", tmp_path / "shared"
    trusted.mkdir()
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    shutil.copy(fake_libnrt.path, trusted / "libnrt.so.1")
    (shared / "planted.so").write_bytes(b"not the library the check saw")
    link = shared / "libnrt.so.1"
    link.symlink_to(trusted / "libnrt.so.1")
    real_check = nrt.check_trusted_library

    def check_then_swap(path):
        checked = real_check(path)
        link.unlink()
        link.symlink_to(shared / "planted.so")  # another user, between the check and dlopen
        return checked

    monkeypatch.setattr(nrt, "check_trusted_library", check_then_swap)
    monkeypatch.setenv("NEURON_RT_LIB", str(link))
    assert nrt.load().path == str(trusted / "libnrt.so.1")


def test_a_relative_or_bare_libnrt_never_loads_from_the_current_folder(tmp_path, monkeypatch):
    """A relative NEURON_RT_LIB, or the bare name find_library returns, was turned into
    ./libnrt.so.1 whenever the current folder had a file of that name."""
    (tmp_path / "libnrt.so.1").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NEURON_RT_LIB", "./libnrt.so.1")
    with pytest.raises(OSError, match="relative"):
        nrt.load()
    monkeypatch.delenv("NEURON_RT_LIB")
    monkeypatch.setattr("polyaccel.neuron.plugin.LIBNRT_PATHS", ())
    monkeypatch.setattr("ctypes.util.find_library", lambda name: "libnrt.so.1")
    opened = []
    monkeypatch.setattr(nrt, "Libnrt", lambda path: opened.append(path) or path)
    monkeypatch.setattr(nrt, "_libs", {})
    nrt.load()
    assert opened == ["libnrt.so.1"]  # dlopen's search, not the file in the current folder


def _loads_since(lib, start: int) -> list[int]:
    """``start_nc`` of every nrt_load the fake libnrt saw since call number ``start``."""
    return [lib.lib.fake_loaded_core(i) for i in range(start, lib.lib.fake_load_count())]


def test_replicas_load_on_core_indices_relative_to_the_visible_cores(fake_libnrt, tmp_path, monkeypatch):
    """libnrt numbers the cores a process sees from 0 (nrt-api-guide, nrt_load's start_nc: with
    NEURON_RT_VISIBLE_CORES=3,4 "the two NeuronCores will be referred to as 0 and 1"). With 8-15
    visible, replica_cores gave the absolute ids 8..15 (nrt_load: not enough cores), and
    replica_factory loaded a 9th replica on a core index the process does not have."""
    from polyaccel.neuron.plugin import NeuronBackend

    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "8-15")
    fake_libnrt.close()  # libnrt reads the visible cores at nrt_init: the factory restarts it
    assert NeuronBackend().replica_cores(8) == list(range(8))
    (tmp_path / "g.neff").write_bytes(b"FAKE 4 0")
    neffs = {"g": tmp_path / "g.neff"}
    factory = runtime.replica_factory(neffs, lib_path=fake_libnrt.path)
    start = fake_libnrt.lib.fake_load_count()
    replicas = [factory(i) for i in range(8)]
    assert _loads_since(fake_libnrt, start) == list(range(8))
    assert [r.core for r in replicas] == list(range(8))
    with pytest.raises(ValueError, match="only 8 of the 8 visible cores"):
        factory(8)
    assert _loads_since(fake_libnrt, start) == list(range(8))  # refused before nrt_load
    with pytest.raises(ValueError, match="not absolute core ids"):
        runtime.replica_factory(neffs, first_core=8, lib_path=fake_libnrt.path)
    for r in replicas:
        r.close()


def test_more_replicas_than_visible_cores_only_when_sharing_is_asked_for(fake_libnrt, tmp_path, monkeypatch):
    from polyaccel.neuron.plugin import NeuronBackend

    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "8-11")
    fake_libnrt.close()  # libnrt reads the visible cores at nrt_init: the factory restarts it
    with pytest.raises(ValueError, match="share=True"):
        NeuronBackend().replica_cores(5)
    assert NeuronBackend().replica_cores(6, share=True) == [0, 1, 2, 3, 0, 1]
    (tmp_path / "g.neff").write_bytes(b"FAKE 4 0")
    factory = runtime.replica_factory({"g": tmp_path / "g.neff"}, first_core=2, lib_path=fake_libnrt.path,
                                      share_cores=True)
    start = fake_libnrt.lib.fake_load_count()
    replicas = [factory(i) for i in range(4)]
    assert _loads_since(fake_libnrt, start) == [2, 3, 2, 3]  # round-robin over the cores from index 2
    for r in replicas:
        r.close()


# ---- error paths against the fake's fault injection and handle tracking ------------------------


def _live(lib) -> tuple[int, int, int, int]:
    """(models, tensor sets, tensors, tensor-info tables) the fake libnrt holds right now."""
    f = lib.lib
    return f.fake_live_models(), f.fake_live_sets(), f.fake_live_tensors(), f.fake_live_infos()


@pytest.fixture
def faults(fake_libnrt):
    """``faults("nrt_execute", 5, skip=0)``: that call returns the status once, after ``skip``
    successful calls. Cleared after the test; the test also asserts no handle was misused."""
    misuse = fake_libnrt.lib.fake_misuse()

    def inject(call: str, status: int, skip: int = 0) -> None:
        assert fake_libnrt.lib.fake_fail(call.encode(), status, skip) == 0

    yield inject
    fake_libnrt.lib.fake_clear_faults()
    assert fake_libnrt.lib.fake_misuse() == misuse, "a freed or closed handle was used"


@pytest.fixture
def private_libnrt(fake_libnrt, tmp_path):
    """A Libnrt of its own (a copy of the fake: its own globals), for tests that close the runtime."""
    so = tmp_path / "own" / "libnrt.so.1"
    so.parent.mkdir()
    shutil.copy(fake_libnrt.path, so)
    lib = nrt.Libnrt(str(so))
    lib.init()
    yield lib
    lib.close()


def test_a_failing_nrt_load_is_a_named_error_and_loads_nothing(fake_libnrt, faults):
    before = _live(fake_libnrt)
    faults("nrt_load", 4)
    with pytest.raises(nrt.NrtError, match=r"nrt_load failed: NRT_RESOURCE \(4\) \[core 6\]") as e:
        runtime.NeuronModel(b"FAKE 4 0", core=6, lib=fake_libnrt)
    assert (e.value.call, e.value.status) == ("nrt_load", "NRT_RESOURCE")
    assert _live(fake_libnrt) == before


@pytest.mark.parametrize("code,status", [(5, "NRT_TIMEOUT"), (1002, "NRT_EXEC_BAD_INPUT"), (1201, "NRT_EXEC_HW_ERR_1")])
def test_a_failing_execute_is_a_named_error_and_the_model_stays_usable(fake_libnrt, faults, code, status):
    model = runtime.NeuronModel(b"FAKE 4 0", core=4, lib=fake_libnrt)
    faults("nrt_execute", code)
    with pytest.raises(nrt.NrtError, match=rf"nrt_execute failed: {status} \({code}\) \[core 4\]") as e:
        model.execute([np.ones(4, np.float32)])
    assert e.value.code == code
    (y,) = model.execute([np.ones(4, np.float32)])
    np.testing.assert_array_equal(y, np.full(4, 2, np.float32))
    model.close()


@pytest.mark.parametrize("call,skip", [
    ("nrt_get_model_tensor_info", 0),
    ("nrt_allocate_tensor_set", 0),  # the input set
    ("nrt_allocate_tensor_set", 1),  # the output set, after the inputs were allocated and bound
    ("nrt_tensor_allocate", 0),
    ("nrt_tensor_allocate", 1),  # output0, after input0 was allocated and bound
    ("nrt_add_tensor_to_tensor_set", 1),  # output0 allocated but not bound
])
def test_a_partial_setup_failure_frees_every_handle_made_so_far(fake_libnrt, faults, call, skip):
    before = _live(fake_libnrt)
    faults(call, 4, skip)
    with pytest.raises(nrt.NrtError, match=rf"{call} failed: NRT_RESOURCE \(4\) \[core 2") as e:
        runtime.NeuronModel(b"FAKE 4 0", core=2, lib=fake_libnrt)
    assert e.value.call == call
    assert _live(fake_libnrt) == before  # no model, set, tensor or tensor-info table left behind


def test_a_failing_cleanup_does_not_hide_the_setup_error(fake_libnrt, faults):
    before = _live(fake_libnrt)
    faults("nrt_tensor_allocate", 4, 1)
    faults("nrt_unload", 1)
    with pytest.raises(nrt.NrtError, match="nrt_tensor_allocate failed: NRT_RESOURCE") as e:
        runtime.NeuronModel(b"FAKE 4 0", core=2, lib=fake_libnrt)
    assert any("nrt_unload failed: NRT_FAILURE" in note for note in e.value.__notes__)
    assert _live(fake_libnrt)[1:] == before[1:]  # sets and tensors freed although the unload failed


def test_a_replica_whose_second_graph_fails_to_load_closes_the_first(fake_libnrt, faults):
    """NeuronReplica loaded its graphs one by one; when one failed, those already loaded stayed
    on the core until garbage collection (the pool keeps the error, and with it the replica)."""
    before = _live(fake_libnrt)
    faults("nrt_load", 9, 1)
    with pytest.raises(nrt.NrtError, match="NRT_LOAD_NOT_ENOUGH_NC") as kept:  # kept, as a pool keeps it
        runtime.NeuronReplica({"encode": b"FAKE 4 0", "decode": b"FAKE 4 0"}, core=1, lib=fake_libnrt)
    assert _live(fake_libnrt) == before and kept.value.call == "nrt_load"


def _execute_in_thread(model, x):
    out: dict = {}

    def run():
        try:
            out["y"] = model.execute([x])
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _wait_executing(lib, n: int = 1) -> None:
    deadline = time.monotonic() + 5
    while lib.lib.fake_executing() < n:
        assert time.monotonic() < deadline, "nrt_execute never started"
        time.sleep(0.002)


def test_closing_a_model_during_execute_waits_for_it_and_later_calls_are_refused(fake_libnrt, faults):
    """close() freed the tensors and unloaded the model while another thread's nrt_execute was
    still using them (the GIL is released in the call): a use-after-free in libnrt."""
    model = runtime.NeuronModel(b"FAKE 4 200", core=5, lib=fake_libnrt)
    x = np.arange(4, dtype=np.float32)
    t, out = _execute_in_thread(model, x)
    _wait_executing(fake_libnrt)
    model.close()  # returns only once the running execute is done
    assert fake_libnrt.lib.fake_executing() == 0
    t.join()
    assert "error" not in out, out
    np.testing.assert_array_equal(out["y"][0], 2 * x)
    with pytest.raises(RuntimeError, match="model on NeuronCore 5 is closed"):
        model.execute([x])
    model.close()  # idempotent


def test_executes_on_one_model_from_two_threads_take_turns(fake_libnrt, faults):
    """Two threads on one model wrote into the same input tensor: the first call could run on
    (and return the result of) the second call's input."""
    model = runtime.NeuronModel(b"FAKE 4 100", core=6, lib=fake_libnrt)
    xa, xb = np.full(4, 1, np.float32), np.full(4, 7, np.float32)
    ta, outa = _execute_in_thread(model, xa)
    _wait_executing(fake_libnrt)
    tb, outb = _execute_in_thread(model, xb)
    ta.join()
    tb.join()
    np.testing.assert_array_equal(outa["y"][0], 2 * xa)
    np.testing.assert_array_equal(outb["y"][0], 2 * xb)
    model.close()


def test_closing_the_runtime_closes_its_models_first_and_waits_for_execute(private_libnrt):
    """nrt_close ran with models still loaded and an execute in flight; closing those models
    afterwards (explicitly or at garbage collection) handed freed handles to a closed runtime."""
    lib = private_libnrt
    busy = runtime.NeuronModel(b"FAKE 4 200", core=0, lib=lib)
    idle = runtime.NeuronModel(b"FAKE 4 0", core=1, lib=lib)
    x = np.ones(4, np.float32)
    t, out = _execute_in_thread(busy, x)
    _wait_executing(lib)
    lib.close()
    t.join()
    assert "error" not in out, out
    assert lib.lib.fake_closed_with_live() == 0  # nothing was loaded when nrt_close ran
    assert busy.closed and idle.closed
    idle.close()
    busy.close()
    del idle, busy
    lib.close()  # idempotent: nrt_close once
    assert lib.lib.fake_close_calls() == 1
    assert lib.lib.fake_misuse() == 0


def test_a_model_made_after_the_runtime_closed_runs_on_a_new_runtime(private_libnrt):
    lib = private_libnrt
    lib.close()
    model = runtime.NeuronModel(b"FAKE 2 0", core=0, lib=lib)  # nrt_init again
    (y,) = model.execute([np.ones(2, np.float32)])
    np.testing.assert_array_equal(y, np.full(2, 2, np.float32))
    model.close()
    assert lib.lib.fake_misuse() == 0


@pytest.mark.parametrize("neff,match", [
    (b"FAKE 4 0 0xE", r"'input0' has a dtype polyaccel cannot convert \(NRT_DTYPE_FP8_E4\)"),
    (b"FAKE 4 0 0x30", r"'input0' has a dtype polyaccel cannot convert \(nrt dtype code 0x30\)"),
    (b"FAKE 4 0 0xA 12", r"'input0': 12 bytes do not hold shape \(4,\) of float32"),
    (b"FAKE 4 0 0xA 16 99", r"'input0': rank 99 .* is not a valid tensor-info entry"),  # the table is freed too
])
def test_a_neff_tensor_we_cannot_convert_is_refused_at_load(fake_libnrt, faults, neff, match):
    """A tensor of a dtype code we had no NumPy type for was read as raw bytes (outputs failed
    in reshape, inputs were written without any dtype check); a size that disagreed with the
    shape failed later in reshape."""
    before = _live(fake_libnrt)
    with pytest.raises(ValueError, match=match):
        runtime.NeuronModel(neff, core=0, lib=fake_libnrt)
    assert _live(fake_libnrt) == before


def test_integer_dtype_codes_of_nrt_h_map_to_numpy():
    info = nrt.TensorInfo("ids", nrt.USAGE_INPUT, 8, nrt.CODE_DTYPES[0x5], (4,), 0x5)
    info.check()
    assert info.dtype == np.uint16


def test_neff_files_are_read_only_when_regular_nonempty_and_ours(tmp_path, monkeypatch):
    good = tmp_path / "g.neff"
    good.write_bytes(b"FAKE 4 0")
    good.chmod(0o644)
    assert runtime.read_neff(good) == b"FAKE 4 0"
    empty = tmp_path / "empty.neff"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        runtime.read_neff(empty)
    fifo = tmp_path / "pipe.neff"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):  # would have blocked forever
        runtime.read_neff(fifo)
    shared = tmp_path / "shared.neff"
    shared.write_bytes(b"FAKE 4 0")
    shared.chmod(0o664)
    with pytest.raises(PermissionError, match="not writable by others: chmod go-w"):
        runtime.read_neff(shared)
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1 if os.getuid() else 4242)
    if os.getuid() == 0:
        os.chown(good, 4243, -1)
    with pytest.raises(PermissionError, match="owned by uid"):
        runtime.read_neff(good)


def test_replica_factory_reads_neffs_through_the_checks(fake_libnrt, tmp_path, monkeypatch):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-7")
    (tmp_path / "g.neff").write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        runtime.replica_factory({"g": tmp_path / "g.neff"}, lib_path=fake_libnrt.path)


def test_changing_the_visible_cores_after_the_runtime_started_is_refused(private_libnrt, tmp_path, monkeypatch):
    """libnrt reads NEURON_RT_VISIBLE_CORES once, at nrt_init. configure_lnc1() or a new
    NEURON_RT_VISIBLE_CORES after the first model loaded changed nothing in the runtime, while
    replica_factory numbered cores from the new value: replicas landed on other cores than
    asked, or failed with NRT_LOAD_NOT_ENOUGH_NC."""
    lib = private_libnrt
    monkeypatch.setattr(nrt, "_libs", {lib.path: lib})
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-7")
    lib.close()
    lib.init()  # started with 0-7
    with pytest.raises(RuntimeError, match=r"NEURON_RT_VISIBLE_CORES='8-15' but the Neuron runtime was started "
                                           r"with NEURON_RT_VISIBLE_CORES='0-7'"):
        runtime.configure_lnc1(first_core=8)
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "0-7"  # nothing half-changed
    (tmp_path / "g.neff").write_bytes(b"FAKE 4 0")
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4-7")
    factory = runtime.replica_factory({"g": tmp_path / "g.neff"}, lib_path=lib.path)
    loads = lib.lib.fake_load_count()
    with pytest.raises(RuntimeError, match="set it .* before the first model loads"):
        factory(0)
    assert lib.lib.fake_load_count() == loads  # refused before nrt_load
    lib.close()  # a restarted runtime takes the new value
    factory(0).close()
    assert lib.init_env["NEURON_RT_VISIBLE_CORES"] == "4-7"
    assert runtime.configure_lnc1(4, first_core=4)["NEURON_RT_VISIBLE_CORES"] == "4-7"  # the same: fine


def test_nrt_load_gets_the_neff_bytes_without_another_copy(fake_libnrt):
    """Libnrt.load copied every NEFF into a ctypes buffer first: with eight replicas loading a
    NEFF of several GB at once, eight extra copies sat in host memory."""
    import tracemalloc

    neff = b"FAKE 4 0 " + b" " * (32 << 20)
    tracemalloc.start()
    try:
        model = fake_libnrt.load(neff, 0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < len(neff) // 2, f"{peak} bytes allocated to load a {len(neff)}-byte NEFF"
    fake_libnrt.check("nrt_unload", fake_libnrt.lib.nrt_unload(model))


@pytest.mark.parametrize("code,restarts,ok", [(6, 1, True), (5, 1, True), (1002, 0, False)])
def test_a_core_failure_rebuilds_the_replica_an_input_error_fails_the_item(fake_libnrt, faults, tmp_path,
                                                                            monkeypatch, code, restarts, ok):
    """A hardware error or timeout in nrt_execute was an ordinary exception: the pool retried
    the items one by one on the same core. Now such statuses raise ReplicaDied (the replica is
    closed, loaded again, the item re-run); a bad input stays that item's error."""
    from polyaccel.core.runtime import ReplicaPool

    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    fake_libnrt.close()  # libnrt reads the visible cores at nrt_init: the factory restarts it
    (tmp_path / "g.neff").write_bytes(b"FAKE 4 0")
    factory = runtime.replica_factory({"g": tmp_path / "g.neff"}, lib_path=fake_libnrt.path)
    before = _live(fake_libnrt)
    with ReplicaPool(factory, 1, restart_backoff_s=0) as pool:
        faults("nrt_execute", code)
        (result,) = list(pool.map([[np.ones(4, np.float32)]]))
        assert pool.metrics().restarts == restarts
    assert result.ok is ok, result.error
    if ok:
        np.testing.assert_array_equal(result.value[0], np.full(4, 2, np.float32))
    else:
        assert isinstance(result.error, nrt.NrtError) and result.error.status == "NRT_EXEC_BAD_INPUT"
    assert _live(fake_libnrt) == before  # the dead replica's model was unloaded and its tensors freed
