/* attnhub_speedups._step_values: a step's LENGTHS and VALUES rules (attnhub/validation.py) in one
 * pass over its host copies, for AttentionMetadataBuilder.build's full checks.
 *
 * step_values(...) returns None where any rule fails (or where an argument is not what the
 * Python side proved: attnhub then runs its own rules, which word the error), else the tuple
 * (max_slot, max_block, min_slot, min_query_len, min_context_len) that validation.STEP returns.
 *
 * Every arithmetic step mirrors the Python rules exactly, numpy's int64 wrap-around included:
 * the query lengths qsl[1:] - qsl[:-1] and the context lengths seq - qlens in int64 (exact for
 * int32 data), a request's block count (seq + block_size - 1) // block_size in int64; what
 * Python computes on its ints (the uniform-step test, ceil(max seq / block_size), the shortest
 * context of a uniform step) is computed here in 128 bits, exactly.
 *
 * Memory: the caller (validation.FAST_STEP) passes data pointers of contiguous host tensors
 * and counts read from their shapes after the structure rules held: qsl holds B + 1 entries,
 * seq B, slots n_slots, the table B * width. Nothing else is read.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef __int128 i128;

static inline int64_t
at(const void *p, int isz, Py_ssize_t i)
{
    return isz == 4 ? (int64_t)((const int32_t *)p)[i] : ((const int64_t *)p)[i];
}

/* a - b in int64, wrapping as numpy's int64 subtraction does */
static inline int64_t
sub64(int64_t a, int64_t b)
{
    return (int64_t)((uint64_t)a - (uint64_t)b);
}

/* floor(a / b) for b > 0 (Python's and numpy's //) */
static inline int64_t
floor_div(int64_t a, int64_t b)
{
    int64_t q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

/* Whether two non-negative entries of slots[0..n) are equal (n >= 2). */
static int
has_duplicate(const void *slots, int isz, Py_ssize_t n, int *failed)
{
    int64_t stack[4096];
    Py_ssize_t cap = 4;
    int bits = 2;
    while (cap < 2 * n) {
        cap <<= 1;
        bits++;
    }
    int64_t *table = stack;
    if (cap > (Py_ssize_t)(sizeof(stack) / sizeof(stack[0]))) {
        table = PyMem_Malloc((size_t)cap * sizeof(int64_t));
        if (table == NULL) {
            *failed = 1;
            return 0;
        }
    }
    memset(table, 0xff, (size_t)cap * sizeof(int64_t)); /* -1: empty */
    const uint64_t mask = (uint64_t)cap - 1;
    int dup = 0;
    for (Py_ssize_t i = 0; i < n && !dup; i++) {
        int64_t s = at(slots, isz, i);
        if (s < 0)
            continue;
        uint64_t h = ((uint64_t)s * 0x9E3779B97F4A7C15ULL) >> (64 - bits);
        for (;; h = (h + 1) & mask) {
            if (table[h] == -1) {
                table[h] = s;
                break;
            }
            if (table[h] == s) {
                dup = 1;
                break;
            }
        }
    }
    if (table != stack)
        PyMem_Free(table);
    return dup;
}

/* The int64 value of an argument, or 0 with *bad set (not an integer, or outside int64). */
static int64_t
as_int64(PyObject *o, int *bad)
{
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        *bad = 1;
    }
    return (int64_t)v;
}

static const void *
as_pointer(PyObject *o, int *bad)
{
    void *p = PyLong_AsVoidPtr(o);
    if (p == NULL && PyErr_Occurred()) {
        PyErr_Clear();
        *bad = 1;
    }
    return p;
}

enum {
    A_QSL, A_QSL_ISZ, A_SEQ, A_SEQ_ISZ, A_B, A_BLOCK_SIZE, A_NUM_ACTUAL_TOKENS,
    A_MAX_QUERY_LEN, A_MAX_SEQ_LEN, A_SLOTS, A_SLOTS_ISZ, A_NUM_SLOTS, A_TABLE,
    A_TABLE_ISZ, A_WIDTH, N_ARGS
};

typedef struct {
    const void *qsl, *seq, *slots, *table;
    int qsl_isz, seq_isz, slots_isz, table_isz;
    int64_t B, block_size, num_actual_tokens, max_query_len, max_seq_len, n_slots, width;
    /* num_actual_tokens, max_query_len or max_seq_len outside int64: the rules compare them
     * with lengths only where there are requests (then they cannot be equal) */
    int huge_scalar;
} Step;

/* The arguments, or 0 where one is not what the Python side proves (then no rule is read). */
static int
parse(PyObject *const *args, Step *s)
{
    int bad = 0;
    s->qsl = as_pointer(args[A_QSL], &bad);
    s->seq = as_pointer(args[A_SEQ], &bad);
    s->slots = as_pointer(args[A_SLOTS], &bad);
    s->table = as_pointer(args[A_TABLE], &bad);
    s->qsl_isz = (int)as_int64(args[A_QSL_ISZ], &bad);
    s->seq_isz = (int)as_int64(args[A_SEQ_ISZ], &bad);
    s->slots_isz = (int)as_int64(args[A_SLOTS_ISZ], &bad);
    s->table_isz = (int)as_int64(args[A_TABLE_ISZ], &bad);
    s->B = as_int64(args[A_B], &bad);
    s->block_size = as_int64(args[A_BLOCK_SIZE], &bad);
    int huge = 0;
    s->num_actual_tokens = as_int64(args[A_NUM_ACTUAL_TOKENS], &huge);
    s->max_query_len = as_int64(args[A_MAX_QUERY_LEN], &huge);
    s->max_seq_len = as_int64(args[A_MAX_SEQ_LEN], &huge);
    s->huge_scalar = huge;
    s->n_slots = as_int64(args[A_NUM_SLOTS], &bad);
    s->width = as_int64(args[A_WIDTH], &bad);
    int sizes_ok = 1;
    const int isz[4] = {s->qsl_isz, s->seq_isz, s->slots_isz, s->table_isz};
    for (int i = 0; i < 4; i++)
        sizes_ok &= isz[i] == 4 || isz[i] == 8;
    return !bad && sizes_ok && s->B >= 0 && s->block_size > 0 && s->n_slots >= 0 &&
           s->width >= 0;
}

/* LENGTHS (for B >= 1): 1 where every rule holds, with the shortest query and context. */
static int
lengths(const Step *s, int64_t *lo_q_out, int64_t *lo_c_out)
{
    const int64_t B = s->B;
    if (s->huge_scalar)
        return 0; /* a length the rules compare with it is an int64 */
    int64_t prev = at(s->qsl, s->qsl_isz, 0);
    const int64_t qsl0 = prev;
    int64_t hi_q = INT64_MIN, lo_q = INT64_MAX, lo_ctx = INT64_MAX;
    int64_t lo_s = INT64_MAX, hi_s = INT64_MIN;
    for (int64_t r = 0; r < B; r++) {
        const int64_t next = at(s->qsl, s->qsl_isz, r + 1);
        const int64_t q = sub64(next, prev); /* int64, as validation's _SUB(..., _I64) */
        const int64_t seq = at(s->seq, s->seq_isz, r);
        const int64_t ctx = sub64(seq, q);
        prev = next;
        hi_q = q > hi_q ? q : hi_q;
        lo_q = q < lo_q ? q : lo_q;
        lo_ctx = ctx < lo_ctx ? ctx : lo_ctx;
        lo_s = seq < lo_s ? seq : lo_s;
        hi_s = seq > hi_s ? seq : hi_s;
    }
    const int64_t total = prev;
    /* the query lens sum to B times the longest: validation's "uniform" step */
    const int uniform = (i128)total - (i128)qsl0 == (i128)B * (i128)hi_q;
    const int64_t shortest_q = uniform ? hi_q : lo_q;
    const i128 shortest_c = uniform ? (i128)lo_s - (i128)hi_q : (i128)lo_ctx;
    const i128 bs = s->block_size;
    const i128 blocks = hi_s >= 0 ? ((i128)hi_s + bs - 1) / bs : -((-(i128)hi_s) / bs);
    if (qsl0 != 0 || shortest_q < 1 || shortest_c < 0 || total != s->num_actual_tokens ||
        s->n_slots < total || blocks > s->width || hi_q != s->max_query_len ||
        hi_s != s->max_seq_len)
        return 0;
    *lo_q_out = shortest_q;
    *lo_c_out = (int64_t)shortest_c; /* 0 <= shortest_c <= lo_s */
    return 1;
}

/* Slot rules: 1 where every slot is >= -1 and no two written ones are equal; -1: no memory. */
static int
slot_values(const Step *s, int64_t *lo_out, int64_t *hi_out)
{
    const Py_ssize_t n = (Py_ssize_t)s->n_slots;
    int64_t lo = -1, hi = -1;
    int increasing = 1; /* the written slots strictly increase: distinct without a look-up */
    int64_t last = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t v = at(s->slots, s->slots_isz, i);
        if (i == 0 || v < lo)
            lo = v;
        if (i == 0 || v > hi)
            hi = v;
        if (v >= 0) {
            increasing &= v > last;
            last = v;
        }
    }
    *lo_out = lo;
    *hi_out = hi;
    if (lo < -1)
        return 0;
    if (n < 2 || increasing)
        return 1;
    int failed = 0;
    const int dup = has_duplicate(s->slots, s->slots_isz, n, &failed);
    return failed ? -1 : !dup;
}

/* Block rules (B >= 1, width >= 1): 1 where no entry a request reads is negative. */
static int
block_values(const Step *s, int64_t *max_out)
{
    const int64_t B = s->B, width = s->width, bs = s->block_size;
    int64_t top = INT64_MIN;
    int negative = 0;
    const Py_ssize_t n = (Py_ssize_t)(B * width);
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t v = at(s->table, s->table_isz, i);
        top = v > top ? v : top;
        negative |= v < 0;
    }
    *max_out = top;
    if (!negative)
        return 1;
    for (int64_t r = 0; r < B; r++) {
        /* (seq.astype(int64) + block_size - 1) // block_size, wrapping as numpy does */
        const int64_t seq = at(s->seq, s->seq_isz, r);
        const int64_t used = floor_div((int64_t)((uint64_t)seq + (uint64_t)(bs - 1)), bs);
        const int64_t read = used < width ? used : width;
        for (int64_t j = 0; j < read; j++)
            if (at(s->table, s->table_isz, r * width + j) < 0)
                return 0;
    }
    return 1;
}

PyDoc_STRVAR(step_values_doc,
"step_values(qsl, qsl_itemsize, seq, seq_itemsize, num_reqs, block_size, num_actual_tokens,\n"
"            max_query_len, max_seq_len, slots, slots_itemsize, num_slots, table,\n"
"            table_itemsize, width)\n"
"--\n\n"
"A step's length and value rules (attnhub.validation's LENGTHS and VALUES) over its host\n"
"copies, given as data pointers of contiguous int32/int64 buffers (itemsize 4 or 8) holding\n"
"num_reqs + 1 query start offsets, num_reqs sequence lengths, num_slots slots and a\n"
"[num_reqs, width] block table. None where a rule fails, else (max_slot, max_block,\n"
"min_slot, min_query_len, min_context_len).");

static PyObject *
step_values(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != N_ARGS) {
        PyErr_Format(PyExc_TypeError, "step_values takes %d arguments (%zd given)", N_ARGS, nargs);
        return NULL;
    }
    Step s;
    if (!parse(args, &s))
        Py_RETURN_NONE;
    int64_t lo_q = 0, lo_c = 0, lo = -1, hi = -1, max_block = -1;
    if (s.B > 0 && !lengths(&s, &lo_q, &lo_c))
        Py_RETURN_NONE;
    const int slots_ok = slot_values(&s, &lo, &hi);
    if (slots_ok < 0)
        return PyErr_NoMemory();
    if (!slots_ok)
        Py_RETURN_NONE;
    /* B >= 1 with an empty table: numpy's max of nothing raises; Python words it */
    if (s.B > 0 && (s.width == 0 || !block_values(&s, &max_block)))
        Py_RETURN_NONE;
    return Py_BuildValue("(LLLLL)", (long long)hi, (long long)max_block, (long long)lo,
                         (long long)lo_q, (long long)lo_c);
}

static PyMethodDef methods[] = {
    {"step_values", (PyCFunction)(void (*)(void))step_values, METH_FASTCALL, step_values_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "attnhub_speedups._step_values",
    "A step's length and value checks in one compiled pass (see step_values).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__step_values(void)
{
    return PyModule_Create(&module_def);
}
