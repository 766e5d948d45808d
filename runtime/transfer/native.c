/* The compiled fast path of a transfer: the page-id check, the one-call move and the CPU copy.
   A CPython extension module built at install (setup.py) and loaded by native.py, which says why. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <pthread.h>
#include <unistd.h>

enum { DEV_USED, DEV_PAGES, HOST_USED, HOST_PAGES, DEV_MARKS, HOST_MARKS, GEN, ENTRIES, CAP, NEXT, ROWS,
       ROW_WORDS, QUERY, LAUNCH, BUCKETS, MIN_BUCKET, ERR, WANT_ENTRY, WANT_INDEX, WANT_SIZE, RING };
enum { MARK, OWNED, END, PER_ENTRY };
enum { IDS_BAD = -1, NEED_GRAPH = -2, BUSY = -3, OWNED_ENTRY = -4, CUDA_ERROR = -5, NOT_HANDLED = -6 };
#define NOT_READY 600 /* cudaErrorNotReady */

typedef int (*query_fn)(void *event);
typedef int (*launch_fn)(void *exec, void *stream);

/* a 1-D contiguous int64 vector (numpy int64); 0 when obj is not one (no exception left set) */
static int int64_vector(PyObject *obj, Py_buffer *view, int writable)
{
    int flags = PyBUF_ND | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) != 0) {
        PyErr_Clear();
        return 0;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    if (view->ndim != 1 || view->itemsize != 8 || !((*f == 'l' || *f == 'q') && f[1] == 0)) {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

/* torch.Tensor and torch.int64 (``configure``), and attribute names: a 1-D contiguous int64 CPU
   tensor is read in place too, without a numpy view made for it */
static PyObject *tensor_type, *int64_dtype, *s_dtype, *s_is_cpu, *s_dim, *s_is_contiguous, *s_numel, *s_data_ptr;

static int is_true_attr(PyObject *obj, PyObject *name, int call)
{
    PyObject *v = call ? PyObject_CallMethodNoArgs(obj, name) : PyObject_GetAttr(obj, name);
    int ok = v == Py_True;
    Py_XDECREF(v);
    return ok;
}

static int64_t int_call(PyObject *obj, PyObject *name)
{
    PyObject *v = PyObject_CallMethodNoArgs(obj, name);
    int64_t out = v ? (int64_t)PyLong_AsLongLong(v) : -1;
    Py_XDECREF(v);
    return out;
}

/* ids: a numpy int64 vector (buffer) or a torch int64 CPU vector; 0 when obj is neither */
typedef struct { Py_buffer view; int has_view; const int64_t *data; int64_t n; } ids_t;

static int ids_of(PyObject *obj, ids_t *ids)
{
    ids->has_view = 0;
    if (tensor_type && PyObject_TypeCheck(obj, (PyTypeObject *)tensor_type)) {
        PyObject *dtype = PyObject_GetAttr(obj, s_dtype);
        int ok = dtype == int64_dtype;
        Py_XDECREF(dtype);
        ok = ok && is_true_attr(obj, s_is_cpu, 0) && int_call(obj, s_dim) == 1 && is_true_attr(obj, s_is_contiguous, 1);
        if (ok) {
            ids->n = int_call(obj, s_numel);
            PyObject *ptr = PyObject_CallMethodNoArgs(obj, s_data_ptr);
            ids->data = ptr ? (const int64_t *)PyLong_AsVoidPtr(ptr) : NULL;
            Py_XDECREF(ptr);
            ok = ids->n >= 0 && (ids->data != NULL || ids->n == 0);
        }
        if (!ok)
            PyErr_Clear();
        return ok;
    }
    if (!int64_vector(obj, &ids->view, 0))
        return 0;
    ids->has_view = 1;
    ids->data = (const int64_t *)ids->view.buf;
    ids->n = ids->view.shape[0];
    return 1;
}

static void ids_release(ids_t *ids)
{
    if (ids->has_view)
        PyBuffer_Release(&ids->view);
}

/* 1 when every id of both sides is in range and allocated and no destination id repeats, 0
   otherwise; with out, the ids are written there as they are read (device ids, then host ids) */
static int check_ids(int64_t *ctx, const int64_t *dev, const int64_t *host, int64_t n, int dest_is_device,
                     int64_t *out)
{
    const uint8_t *dev_used = (const uint8_t *)(intptr_t)ctx[DEV_USED];
    const uint8_t *host_used = (const uint8_t *)(intptr_t)ctx[HOST_USED];
    const uint64_t dev_pages = (uint64_t)ctx[DEV_PAGES], host_pages = (uint64_t)ctx[HOST_PAGES];
    int64_t *marks = (int64_t *)(intptr_t)(dest_is_device ? ctx[DEV_MARKS] : ctx[HOST_MARKS]);
    const int64_t generation = ++ctx[GEN];
    for (int64_t i = 0; i < n; i++) {
        uint64_t d = (uint64_t)dev[i], h = (uint64_t)host[i];
        if (d >= dev_pages || h >= host_pages || !dev_used[d] || !host_used[h])
            return 0;
        uint64_t dst = dest_is_device ? d : h;
        if (marks[dst] == generation)
            return 0;
        marks[dst] = generation;
        if (out) {
            out[i] = (int64_t)d;
            out[n + i] = (int64_t)h;
        }
    }
    return 1;
}

/* move(ctx, dev, host, dest_is_device, execs, stream): the ring's next entry (its last reader
   done: one event query), the ids checked into its pinned row, its bucket's graph launched (the
   graph records the entry's events).  The entry, or a code: what the engine must do first, or
   that the general path (which names any bad id) takes the move. */
static long take_entry_and_launch(int64_t *ctx, const int64_t *dev, const int64_t *host, int64_t n,
                                 int dest_is_device, const int64_t *execs, void *stream)
{
    const int64_t k = ctx[NEXT];
    int64_t *entry = ctx + RING + PER_ENTRY * k;
    ctx[WANT_ENTRY] = k;
    if (entry[OWNED])
        return OWNED_ENTRY;
    if (entry[MARK]) {
        int rc = ((query_fn)(intptr_t)ctx[QUERY])((void *)(intptr_t)entry[MARK]);
        if (rc == NOT_READY)
            return BUSY;
        if (rc) {
            ctx[ERR] = rc;
            return CUDA_ERROR;
        }
        entry[MARK] = 0;
    }
    int64_t *row = (int64_t *)(intptr_t)ctx[ROWS] + k * ctx[ROW_WORDS];
    if (!check_ids(ctx, dev, host, n, dest_is_device, row + 1))
        return IDS_BAD;
    row[0] = n;
    int64_t size = ctx[MIN_BUCKET], index = 0;
    while (size < n && size < ctx[CAP]) {
        size <<= 1;
        index++;
    }
    if (size > ctx[CAP])
        size = ctx[CAP];
    const int64_t exec = execs[k * ctx[BUCKETS] + index];
    if (!exec) {
        ctx[WANT_INDEX] = index;
        ctx[WANT_SIZE] = size;
        return NEED_GRAPH;
    }
    int rc = ((launch_fn)(intptr_t)ctx[LAUNCH])((void *)(intptr_t)exec, stream);
    if (rc) {
        ctx[ERR] = rc;
        return CUDA_ERROR;
    }
    entry[MARK] = entry[END];
    entry[OWNED] = 1;
    ctx[NEXT] = (k + 1) % ctx[ENTRIES];
    return (long)k;
}

/* ids_ok(ctx, dev, host, dest_is_device): check_ids on the caller's ids, read in place; None when
   they are not 1-D int64 vectors (the caller converts them and asks again) */
static PyObject *py_ids_ok(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "ids_ok(ctx, dev, host, dest_is_device)");
        return NULL;
    }
    Py_buffer c;
    if (!int64_vector(args[0], &c, 1)) {
        PyErr_SetString(PyExc_TypeError, "ids_ok: ctx must be a writable int64 vector");
        return NULL;
    }
    PyObject *answer = Py_None;
    ids_t d, h;
    if (ids_of(args[1], &d)) {
        if (ids_of(args[2], &h)) {
            if (d.n != h.n)
                answer = Py_False;
            else
                answer = check_ids((int64_t *)c.buf, d.data, h.data, d.n, PyObject_IsTrue(args[3]), NULL)
                    ? Py_True : Py_False;
            ids_release(&h);
        }
        ids_release(&d);
    }
    PyBuffer_Release(&c);
    Py_INCREF(answer);
    return answer;
}

static PyObject *py_move(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "move(ctx, dev, host, dest_is_device, execs, stream)");
        return NULL;
    }
    void *stream = PyLong_AsVoidPtr(args[5]);
    if (stream == NULL && PyErr_Occurred())
        return NULL;
    Py_buffer c, e;
    if (!int64_vector(args[0], &c, 1)) {
        PyErr_SetString(PyExc_TypeError, "move: ctx must be a writable int64 vector");
        return NULL;
    }
    if (!int64_vector(args[4], &e, 0)) {
        PyBuffer_Release(&c);
        PyErr_SetString(PyExc_TypeError, "move: execs must be an int64 vector");
        return NULL;
    }
    long code = NOT_HANDLED;
    int64_t *ctx = (int64_t *)c.buf;
    ids_t d, h;
    if (ids_of(args[1], &d)) {
        if (ids_of(args[2], &h)) {
            if (d.n > 0 && h.n == d.n && d.n <= ctx[CAP])
                code = take_entry_and_launch(ctx, d.data, h.data, d.n, PyObject_IsTrue(args[3]),
                                            (const int64_t *)e.buf, stream);
            ids_release(&h);
        }
        ids_release(&d);
    }
    PyBuffer_Release(&e);
    PyBuffer_Release(&c);
    return PyLong_FromLong(code);
}

static PyObject *py_configure(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "configure(torch.Tensor, torch.int64)");
        return NULL;
    }
    Py_XSETREF(tensor_type, Py_NewRef(args[0]));
    Py_XSETREF(int64_dtype, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

/* copy_pages(table, dev, host, d2h, threads): CPU pools, already checked ids.  table: int64 rows
   of (page bytes, device base, host base, device page stride, host page stride), one per buffer;
   page dev[i] of every buffer to page host[i] (d2h), or back.  One memcpy per page per buffer,
   without the GIL, split over `threads` threads (the caller's included) by bytes: the (buffer,
   page) items in table order, each thread taking those that start in its share of the bytes. */
typedef struct {
    const int64_t *rows, *dev, *host;
    int64_t buffers, n, part, parts;
    int d2h;
} copy_job;

static int64_t first_page_from(int64_t offset, int64_t base, int64_t page, int64_t n)
{
    int64_t i = offset > base ? (offset - base + page - 1) / page : 0;
    return i < n ? i : n;
}

static void *copy_part(void *arg)
{
    const copy_job *j = (const copy_job *)arg;
    int64_t total = 0;
    for (int64_t b = 0; b < j->buffers; b++)
        total += j->n * j->rows[5 * b];
    const int64_t lo = total * j->part / j->parts, hi = total * (j->part + 1) / j->parts;
    int64_t base = 0;
    for (int64_t b = 0; b < j->buffers && base < hi; b++) {
        const int64_t *r = j->rows + 5 * b;
        const int64_t page = r[0], span = j->n * page;
        if (page <= 0 || base + span <= lo) {
            base += span;
            continue;
        }
        char *dev = (char *)(intptr_t)r[1], *host = (char *)(intptr_t)r[2];
        const int64_t i1 = first_page_from(hi, base, page, j->n);
        for (int64_t i = first_page_from(lo, base, page, j->n); i < i1; i++) {
            char *dp = dev + j->dev[i] * r[3], *hp = host + j->host[i] * r[4];
            if (j->d2h)
                memcpy(hp, dp, (size_t)page);
            else
                memcpy(dp, hp, (size_t)page);
        }
        base += span;
    }
    return NULL;
}

#define MAX_COPY_THREADS 16

/* Several threads through OpenMP where the module was built with it: on the same OpenMP runtime
   as torch (one libgomp.so.1 per process), so the copy runs on torch's intra-op threads.  Threads
   of its own lost to torch's: after a torch op its idle OpenMP threads spin for a while, on the
   cores a separate thread pool needs (2 cores: a 64 MiB copy right after one 7.3-8.2 ms, alone
   5.6-6.1).  Built without it, or in a forked child of a process that loaded the module (GNU
   OpenMP's threads do not survive a fork: a parallel region there waits for them forever): a
   thread per part, started per call. */
static pid_t loaded_in;

static void copy_parallel(copy_job *jobs, long parts)
{
#ifdef _OPENMP
    if (getpid() == loaded_in) {
#pragma omp parallel for num_threads(parts) schedule(static, 1)
        for (long k = 0; k < parts; k++)
            copy_part(&jobs[k]);
        return;
    }
#endif
    pthread_t tids[MAX_COPY_THREADS];
    int started[MAX_COPY_THREADS] = {0};
    for (long k = 1; k < parts; k++)
        started[k] = pthread_create(&tids[k], NULL, copy_part, &jobs[k]) == 0;
    copy_part(&jobs[0]);
    for (long k = 1; k < parts; k++) {
        if (started[k])
            pthread_join(tids[k], NULL);
        else
            copy_part(&jobs[k]);  /* no thread to be had: this one does that part too */
    }
}

/* the copy of n checked pages over the table's rows, on `threads` threads (1 when fewer) */
static void copy_rows(const int64_t *rows, int64_t buffers, const ids_t *d, const ids_t *h, int d2h,
                      long threads)
{
    copy_job jobs[MAX_COPY_THREADS];
    threads = threads < 1 ? 1 : threads > MAX_COPY_THREADS ? MAX_COPY_THREADS : threads;
    for (long k = 0; k < threads; k++)
        jobs[k] = (copy_job){rows, d->data, h->data, buffers, d->n, k, threads, d2h};
    Py_BEGIN_ALLOW_THREADS
    if (threads == 1)
        copy_part(&jobs[0]);
    else
        copy_parallel(jobs, threads);
    Py_END_ALLOW_THREADS
}

static int table_of(PyObject *obj, Py_buffer *t, const char *who)
{
    if (int64_vector(obj, t, 0)) {
        if (t->shape[0] % 5 == 0)
            return 1;
        PyBuffer_Release(t);
    }
    PyErr_Format(PyExc_TypeError, "%s: table must be an int64 vector of 5-word rows", who);
    return 0;
}

static PyObject *py_copy_pages(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "copy_pages(table, dev, host, d2h, threads)");
        return NULL;
    }
    long threads = PyLong_AsLong(args[4]);
    if (threads == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer t;
    if (!table_of(args[0], &t, "copy_pages"))
        return NULL;
    ids_t d, h;
    if (!ids_of(args[1], &d)) {
        PyBuffer_Release(&t);
        PyErr_SetString(PyExc_TypeError, "copy_pages: ids must be 1-D int64 arrays or CPU tensors");
        return NULL;
    }
    if (!ids_of(args[2], &h) || h.n != d.n) {
        ids_release(&d);
        PyBuffer_Release(&t);
        PyErr_SetString(PyExc_TypeError, "copy_pages: host ids must match the device ids");
        return NULL;
    }
    copy_rows((const int64_t *)t.buf, t.shape[0] / 5, &d, &h, PyObject_IsTrue(args[3]), threads);
    ids_release(&h);
    ids_release(&d);
    PyBuffer_Release(&t);
    Py_RETURN_NONE;
}

/* copy_checked(ctx, table, dev, host, d2h, threads, threads_from_pages): CPU pools, the caller's
   ids -- the boundary checks of ids_ok, then, only when they all pass, the copy of copy_pages
   (on `threads` threads from `threads_from_pages` pages, else on this one).  True: copied;
   False: an id failed a check and nothing moved; None: the ids are not 1-D int64 vectors (the
   caller converts them, checks and copies the general way, which names what is wrong). */
static PyObject *py_copy_checked(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "copy_checked(ctx, table, dev, host, d2h, threads, threads_from_pages)");
        return NULL;
    }
    long threads = PyLong_AsLong(args[5]);
    long long from_pages = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer c, t;
    if (!int64_vector(args[0], &c, 1)) {
        PyErr_SetString(PyExc_TypeError, "copy_checked: ctx must be a writable int64 vector");
        return NULL;
    }
    if (!table_of(args[1], &t, "copy_checked")) {
        PyBuffer_Release(&c);
        return NULL;
    }
    PyObject *answer = Py_None;
    ids_t d, h;
    if (ids_of(args[2], &d)) {
        if (ids_of(args[3], &h)) {
            const int d2h = PyObject_IsTrue(args[4]);
            if (d.n != h.n || !check_ids((int64_t *)c.buf, d.data, h.data, d.n, !d2h, NULL)) {
                answer = Py_False;
            } else {
                copy_rows((const int64_t *)t.buf, t.shape[0] / 5, &d, &h, d2h, d.n >= from_pages ? threads : 1);
                answer = Py_True;
            }
            ids_release(&h);
        }
        ids_release(&d);
    }
    PyBuffer_Release(&t);
    PyBuffer_Release(&c);
    Py_INCREF(answer);
    return answer;
}

static PyMethodDef methods[] = {
    {"ids_ok", (PyCFunction)(void (*)(void))py_ids_ok, METH_FASTCALL, "the boundary checks in one pass"},
    {"move", (PyCFunction)(void (*)(void))py_move, METH_FASTCALL, "check, fill a entry, launch its graph"},
    {"configure", (PyCFunction)(void (*)(void))py_configure, METH_FASTCALL, "the tensor type ids may come as"},
    {"copy_pages", (PyCFunction)(void (*)(void))py_copy_pages, METH_FASTCALL, "CPU pools: memcpy per page"},
    {"copy_checked", (PyCFunction)(void (*)(void))py_copy_checked, METH_FASTCALL,
     "CPU pools: the checks of ids_ok, then the copy of copy_pages, in one call"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void)
{
    s_dtype = PyUnicode_InternFromString("dtype");
    s_is_cpu = PyUnicode_InternFromString("is_cpu");
    s_dim = PyUnicode_InternFromString("dim");
    s_is_contiguous = PyUnicode_InternFromString("is_contiguous");
    s_numel = PyUnicode_InternFromString("numel");
    s_data_ptr = PyUnicode_InternFromString("data_ptr");
    if (!s_dtype || !s_is_cpu || !s_dim || !s_is_contiguous || !s_numel || !s_data_ptr)
        return NULL;
    loaded_in = getpid();
    return PyModule_Create(&module);
}
