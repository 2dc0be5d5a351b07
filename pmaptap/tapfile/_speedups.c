/* The per-line and per-record loops of reading a tap file, in C.

   Optional: pmaptap/tapfile/speedups.py loads this module when it was
   built (setup.py builds it where a C compiler is found) and the pure
   Python loops run otherwise, or with PMAPTAP_NO_SPEEDUPS=1. Each function
   here is a copy of one Python loop, named beside it, and gives the same
   answer for every input (tests/tapfile/test_speedups.py runs both on
   hostile lines and random runs):

   - plain_records: parse.load_lines + format.first_not_plain, one line at
     a time: a line becomes a record here only when parse_line's own fast
     path would take it (short, at most max_depth opening brackets, orjson
     takes it, a plainly valid record); every other line is left to
     parse_line, the definition, by the caller. With a merge's ``seen``,
     a likely copy of a replicated value in the writers' plain form is
     read without being built (scan_copy): no Python loop does this; the
     tests hold it to parse_line line by line.
   - first_not_plain: format.first_not_plain (plain() on its own, for the
     tests that hold it to the Python check).
   - time_keys: the merge key loop of runs._Source.extend (and, with the
     pieces' lines, set_aside: a likely copy held as its line).
   - merge_round: a round of runs._merge (its sort, and the loop that keeps
     the first copy of a replicated value).
   - per_device_run: summary_batch.BatchSummarizer._add_part's steps for a
     run of the simplest usual per-device records.
   - scalar_clean: checks.schema_problems' fast path (checks._fields_clean
     and a float scalar).
   - validate_run: checks._validate's loop over a run of the simplest
     per-device records (their schema check and duplicate index; each
     device's group kept from its last record, cached_steps).

   Nothing here decides what a record is: these are the fast checks that
   send anything unusual to the Python definitions. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>

static PyObject *k_name, *k_step, *k_kind, *k_run, *k_process, *k_value, *k_dtype, *k_shape,
    *k_time, *k_host, *k_index, *k_pass, *k_vhash, *k_attempt, *k_devices, *k_processes,
    *k_device, *k_coords, *k_replicas, *k_per_device, *k_replicated, *k_meta, *k_why, *k_forward,
    *k_divergent, *k_float, *k_bfloat;
static PyObject *zero;

/* type(o) in format._SCALAR_TYPES: exactly None, str, int, float, bool. */
static int
is_scalar(PyObject *o)
{
    PyTypeObject *t = Py_TYPE(o);
    return o == Py_None || t == &PyUnicode_Type || t == &PyLong_Type || t == &PyFloat_Type ||
           t == &PyBool_Type;
}

/* A devices/processes field as first_not_plain takes it: absent or null, a
   list of scalars, or text id_ranges reads. 1 yes, 0 no, -1 error. */
static int
holders_ok(PyObject *ids, PyObject *id_ranges)
{
    if (ids == NULL || ids == Py_None) {
        return 1;
    }
    if (PyList_CheckExact(ids)) {
        Py_ssize_t n = PyList_GET_SIZE(ids);
        for (Py_ssize_t j = 0; j < n; j++) {
            if (!is_scalar(PyList_GET_ITEM(ids, j))) {
                return 0;
            }
        }
        return 1;
    }
    if (!PyUnicode_CheckExact(ids)) {
        return 0;
    }
    PyObject *got = PyObject_CallOneArg(id_ranges, ids);
    if (got == NULL) {
        return -1;
    }
    int ok = got != Py_None;
    Py_DECREF(got);
    return ok;
}

/* ``o == want`` (op Py_EQ) or ``o != want`` (Py_NE) as Python compares
   them, ``want`` an interned str: exact str without a call (the records
   JSON makes), anything else through its own comparison (as
   format.first_not_plain's ``kind == "per_device"``). 1, 0, -1 error. */
static int
str_eq(PyObject *o, PyObject *want, int op)
{
    if (PyUnicode_CheckExact(o)) {
        int eq = o == want || PyUnicode_Compare(o, want) == 0;
        return op == Py_EQ ? eq : !eq;
    }
    return PyObject_RichCompareBool(o, want, op);
}

/* d[key] or NULL (no error set) when missing; 1 into *err on a failed
   lookup, and then later calls look nothing up (no call runs with an
   exception set): callers test *err once after a few lookups. */
static PyObject *
get(PyObject *d, PyObject *key, int *err)
{
    if (*err) {
        return NULL;
    }
    PyObject *v = PyDict_GetItemWithError(d, key);
    if (v == NULL && PyErr_Occurred()) {
        *err = 1;
    }
    return v;
}

/* The rest of plain(): the holders fields and the kind's own fields. */
static int
plain_kind(PyObject *d, PyObject *kind, PyObject *id_ranges)
{
    int err = 0;
    PyObject *v;
    PyObject *fields[] = {k_devices, k_processes};
    for (size_t j = 0; j < 2; j++) {
        v = get(d, fields[j], &err);
        if (err) {
            return -1;
        }
        int ok = holders_ok(v, id_ranges);
        if (ok <= 0) {
            return ok;
        }
    }
    int is = str_eq(kind, k_per_device, Py_EQ);
    if (is < 0) {
        return -1;
    }
    if (is) {
        v = get(d, k_device, &err);
        if (err) {
            return -1;
        }
        if (v == NULL || !is_scalar(v)) {
            return 0;
        }
        v = get(d, k_coords, &err);
        if (err) {
            return -1;
        }
        return v != NULL && PyDict_CheckExact(v);
    }
    is = str_eq(kind, k_replicated, Py_EQ);
    if (is < 0) {
        return -1;
    }
    if (is) {
        return PyDict_Contains(d, k_replicas);
    }
    is = str_eq(kind, k_meta, Py_NE);
    return is < 0 ? -1 : !is;
}

/* format.first_not_plain for one item: 1 a plainly valid record, 0 not, -1
   error. The same checks in the same terms (see format.first_not_plain). */
static int
plain(PyObject *d, PyObject *id_ranges)
{
    int err = 0;
    if (!PyDict_CheckExact(d)) {
        return 0;
    }
    PyObject *name = get(d, k_name, &err);
    PyObject *step = get(d, k_step, &err);
    PyObject *kind = get(d, k_kind, &err);
    PyObject *run = get(d, k_run, &err);
    PyObject *process = get(d, k_process, &err);
    if (err) {
        return -1;
    }
    if (name == NULL || step == NULL || kind == NULL || run == NULL || process == NULL) {
        return 0;
    }
    if (!PyUnicode_CheckExact(name) || PyUnicode_GET_LENGTH(name) == 0 ||
        !PyLong_CheckExact(step) || !PyUnicode_CheckExact(run) || !is_scalar(process)) {
        return 0;
    }
    PyObject *must[] = {k_value, k_dtype, k_shape, k_time, k_host};
    for (size_t j = 0; j < sizeof(must) / sizeof(must[0]); j++) {
        int has = PyDict_Contains(d, must[j]);
        if (has <= 0) {
            return has;
        }
    }
    int has = PyDict_Contains(d, k_index);
    if (has != 0) {
        return has < 0 ? -1 : 0;
    }
    PyObject *v = get(d, k_pass, &err);
    if (v != NULL && !PyUnicode_CheckExact(v)) {
        return 0;
    }
    v = get(d, k_vhash, &err);
    if (v != NULL && !PyUnicode_CheckExact(v)) {
        return 0;
    }
    v = get(d, k_attempt, &err);
    if (err) {
        return -1;
    }
    if (v != NULL) {
        if (!PyLong_CheckExact(v)) {
            return 0;
        }
        int negative = PyObject_RichCompareBool(v, zero, Py_LT);
        if (negative != 0) {
            return negative < 0 ? -1 : 0;
        }
    }
    /* id_ranges is Python code: the kind (borrowed from d) is held across it. */
    Py_INCREF(kind);
    int ok = plain_kind(d, kind, id_ranges);
    Py_DECREF(kind);
    return ok;
}

/* first_not_plain(records, start, id_ranges) -> int */
static PyObject *
first_not_plain(PyObject *self, PyObject *args)
{
    PyObject *records, *id_ranges;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "O!nO:first_not_plain", &PyList_Type, &records, &start,
                          &id_ranges)) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(records);
    for (Py_ssize_t i = start < 0 ? 0 : start; i < n; i++) {
        PyObject *d = PyList_GET_ITEM(records, i);
        Py_INCREF(d);
        int ok = plain(d, id_ranges);
        Py_DECREF(d);
        if (ok < 0) {
            return NULL;
        }
        if (!ok) {
            return PyLong_FromSsize_t(i);
        }
        n = PyList_GET_SIZE(records);  /* a callback may have changed it */
    }
    return PyLong_FromSsize_t(n);
}

/* The opening brackets of a line, counted until they pass ``limit``. */
static Py_ssize_t
openers(const char *p, Py_ssize_t n, Py_ssize_t limit)
{
    Py_ssize_t count = 0;
    Py_ssize_t j = 0;
    while (j < n) {
        /* In blocks, so the compiler can vectorize the count. */
        Py_ssize_t end = j + 4096 < n ? j + 4096 : n;
        for (; j < end; j++) {
            count += (p[j] == '[') + (p[j] == '{');
        }
        if (count > limit) {
            break;
        }
    }
    return count;
}

/* ---- A copy read without building it (plain_records with ``seen``) ----

   A replicated value is written by every process that holds it, and a
   merge keeps the first copy only: most copies are read to be dropped.
   Building each as a record (orjson's dict of a dozen objects, then
   freed) was most of what they cost. scan_copy reads a line as far as
   the merge needs it (record time, record_key, vhash, process) without
   building it, and only for the lines it can answer for exactly: JSON
   without whitespace, strings of printable ASCII without escapes, numbers
   of bounded size, the fields of a plainly valid replicated record with a
   vhash (format.first_not_plain's rules; devices and processes as lists of
   scalars, null or ranges text). For such a line orjson gives a plainly valid record,
   so parse_line gives that record, with those fields; any other line goes
   to orjson as before. Only a likely copy (``seen`` names another process
   for its value: set_aside's test) is kept as read here; the rest are
   parsed as before. */

typedef struct {
    const char *p, *end;
} Cur;

/* The bytes a string scan_string takes may hold: printable ASCII but the
   quote and the backslash (filled in at the module's init). */
static unsigned char plain_byte[256];

/* A string at c->p ('"'): printable ASCII, no escape. 1 taken, 0 not. */
static int
scan_string(Cur *c, const char **s, Py_ssize_t *n)
{
    const char *q = c->p + 1;
    while (q < c->end && plain_byte[(unsigned char)*q]) {
        q++;
    }
    if (q >= c->end || *q != '"') {
        return 0;
    }
    *s = c->p + 1;
    *n = q - *s;
    c->p = q + 1;
    return 1;
}

/* A value at c->p that is a string scan_string takes. */
static int
string_at(Cur *c, const char **s, Py_ssize_t *n)
{
    return c->p < c->end && *c->p == '"' && scan_string(c, s, n);
}

static int
is_digit(char ch)
{
    return ch >= '0' && ch <= '9';
}

/* A JSON number at c->p with at most 18 digits before its point and 2 in
   its exponent (orjson takes every such number, and none of them
   overflows a double). *is_float: it has a fraction or an exponent;
   *digits: all its mantissa's digits. 1 taken, 0 not. */
static int
scan_number(Cur *c, int *is_float, Py_ssize_t *digits)
{
    const char *q = c->p;
    if (q < c->end && *q == '-') {
        q++;
    }
    const char *d0 = q;
    if (q < c->end && *q == '0') {
        q++;
    }
    else if (q < c->end && *q >= '1' && *q <= '9') {
        while (q < c->end && is_digit(*q)) {
            q++;
        }
    }
    else {
        return 0;
    }
    *digits = q - d0;
    if (*digits > 18) {
        return 0;
    }
    *is_float = 0;
    if (q < c->end && *q == '.') {
        const char *f0 = ++q;
        while (q < c->end && is_digit(*q)) {
            q++;
        }
        if (q == f0) {
            return 0;
        }
        *digits += q - f0;
        *is_float = 1;
    }
    if (q < c->end && (*q == 'e' || *q == 'E')) {
        q++;
        if (q < c->end && (*q == '+' || *q == '-')) {
            q++;
        }
        const char *e0 = q;
        while (q < c->end && is_digit(*q)) {
            q++;
        }
        if (q == e0 || q - e0 > 2) {
            return 0;
        }
        *is_float = 1;
    }
    c->p = q;
    return 1;
}

/* An int of scan_number (no fraction, no exponent) into *out. */
static int
scan_int(Cur *c, long long *out)
{
    const char *s = c->p;
    int is_float;
    Py_ssize_t digits;
    if (!scan_number(c, &is_float, &digits) || is_float) {
        return 0;
    }
    long long v = 0;
    const char *q = s + (*s == '-');
    for (; q < c->p; q++) {
        v = v * 10 + (*q - '0');
    }
    *out = *s == '-' ? -v : v;
    return 1;
}

static int
scan_literal(Cur *c)
{
    static const char *words[] = {"true", "false", "null"};
    for (size_t j = 0; j < 3; j++) {
        size_t n = strlen(words[j]);
        if ((size_t)(c->end - c->p) >= n && memcmp(c->p, words[j], n) == 0) {
            c->p += n;
            return 1;
        }
    }
    return 0;
}

/* A scalar (string, number, true, false, null). */
static int
scan_scalar(Cur *c)
{
    if (c->p >= c->end) {
        return 0;
    }
    const char *s;
    Py_ssize_t n;
    if (*c->p == '"') {
        return scan_string(c, &s, &n);
    }
    if (*c->p == '-' || is_digit(*c->p)) {
        int is_float;
        Py_ssize_t digits;
        return scan_number(c, &is_float, &digits);
    }
    return scan_literal(c);
}

/* Any value, arrays and objects at most ``depth`` deep. */
static int
scan_value(Cur *c, int depth)
{
    if (c->p >= c->end) {
        return 0;
    }
    char open = *c->p;
    if (open != '[' && open != '{') {
        return scan_scalar(c);
    }
    if (depth <= 0) {
        return 0;
    }
    char close = open == '[' ? ']' : '}';
    c->p++;
    if (c->p < c->end && *c->p == close) {
        c->p++;
        return 1;
    }
    for (;;) {
        if (open == '{') {
            const char *s;
            Py_ssize_t n;
            if (!string_at(c, &s, &n) || c->p >= c->end || *c->p != ':') {
                return 0;
            }
            c->p++;
        }
        if (!scan_value(c, depth - 1) || c->p >= c->end) {
            return 0;
        }
        if (*c->p == close) {
            c->p++;
            return 1;
        }
        if (*c->p != ',') {
            return 0;
        }
        c->p++;
    }
}

/* format.MAX_HOLDERS (tests/tapfile/test_speedups.py holds them equal). */
#define MAX_HOLDERS (1 << 20)

/* One id of a ranges text: format._RANGES_TEXT's number, at most 18 digits
   here (its 19th digit is left to id_ranges). */
static int
scan_id(const char **q, const char *end, long long *out)
{
    const char *s = *q, *p = s;
    if (p < end && *p == '0') {
        p++;
    }
    else {
        while (p < end && is_digit(*p) && p - s < 19) {
            p++;
        }
    }
    if (p == s || p - s > 18 || (p < end && is_digit(*p))) {
        return 0;
    }
    long long v = 0;
    for (const char *d = s; d < p; d++) {
        v = v * 10 + (*d - '0');
    }
    *out = v;
    *q = p;
    return 1;
}

/* A holders text format.id_ranges takes (ascending, disjoint ranges of at
   most MAX_HOLDERS ids in all), ``n`` bytes at ``s``. */
static int
ranges_ok(const char *s, Py_ssize_t n)
{
    const char *q = s, *end = s + n;
    long long prev = -1, count = 0;
    if (n == 0) {
        return 0;
    }
    for (;;) {
        long long a, b;
        if (!scan_id(&q, end, &a)) {
            return 0;
        }
        b = a;
        if (q < end && *q == '-') {
            q++;
            if (!scan_id(&q, end, &b)) {
                return 0;
            }
        }
        count += b - a + 1;
        if (a <= prev || b < a || count > MAX_HOLDERS) {
            return 0;
        }
        prev = b;
        if (q == end) {
            return 1;
        }
        if (*q != ',') {
            return 0;
        }
        q++;
    }
}

/* devices / processes: null, a list of scalars (a list one level deep),
   or a ranges text. */
static int
scan_holders(Cur *c)
{
    const char *s;
    Py_ssize_t n;
    if (c->p < c->end && *c->p == '"') {
        return scan_string(c, &s, &n) && ranges_ok(s, n);
    }
    if (c->p < c->end && *c->p == '[') {
        return scan_value(c, 1);
    }
    return c->end - c->p >= 4 && memcmp(c->p, "null", 4) == 0 && (c->p += 4, 1);
}

enum {
    F_RUN = 1 << 0, F_NAME = 1 << 1, F_STEP = 1 << 2, F_KIND = 1 << 3, F_VALUE = 1 << 4,
    F_DTYPE = 1 << 5, F_SHAPE = 1 << 6, F_PROCESS = 1 << 7, F_TIME = 1 << 8, F_HOST = 1 << 9,
    F_REPLICAS = 1 << 10, F_DEVICES = 1 << 11, F_PROCESSES = 1 << 12, F_VHASH = 1 << 13,
    F_PASS = 1 << 14, F_ATTEMPT = 1 << 15, F_INDEX = 1 << 16, F_OTHER = 1 << 17,
};
#define F_NEEDED                                                                              \
    (F_RUN | F_NAME | F_STEP | F_KIND | F_VALUE | F_DTYPE | F_SHAPE | F_PROCESS | F_TIME |   \
     F_HOST | F_REPLICAS | F_VHASH)

static int
field_of(const char *s, Py_ssize_t n)
{
#define IS(name) (memcmp(s, name, (size_t)n) == 0)
    switch (n) {
    case 3:
        return IS("run") ? F_RUN : F_OTHER;
    case 4:
        return IS("name") ? F_NAME
               : IS("step") ? F_STEP
               : IS("kind") ? F_KIND
               : IS("time") ? F_TIME
               : IS("host") ? F_HOST
               : IS("pass") ? F_PASS
                            : F_OTHER;
    case 5:
        return IS("value") ? F_VALUE
               : IS("dtype") ? F_DTYPE
               : IS("shape") ? F_SHAPE
               : IS("vhash") ? F_VHASH
               : IS("index") ? F_INDEX
                             : F_OTHER;
    case 7:
        return IS("process") ? F_PROCESS
               : IS("devices") ? F_DEVICES
               : IS("attempt") ? F_ATTEMPT
                               : F_OTHER;
    case 8:
        return IS("replicas") ? F_REPLICAS : F_OTHER;
    case 9:
        return IS("processes") ? F_PROCESSES : F_OTHER;
    default:
        return F_OTHER;
    }
#undef IS
}

/* The double a decimal number token (scan_number's, ``n`` bytes at ``p``)
   is, where one IEEE operation gives it exactly rounded: an integer
   mantissa below 2**53 and a power of ten up to 10**22 (Clinger's fast
   path; a time as writers round it, 16 digits, is one). 1 done, 0 not (the
   caller parses it in full). */
static int
exact_double(const char *p, Py_ssize_t n, double *out)
{
#if defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD == 0
    static const double tens[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                  1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                  1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};
    const char *q = p, *end = p + n;
    int negative = q < end && *q == '-';
    q += negative;
    unsigned long long m = 0;
    int digits = 0, scale = 0;
    for (; q < end && is_digit(*q); q++, digits++) {
        m = m * 10 + (unsigned long long)(*q - '0');
    }
    if (q < end && *q == '.') {
        for (q++; q < end && is_digit(*q); q++, digits++, scale--) {
            m = m * 10 + (unsigned long long)(*q - '0');
        }
    }
    if (q < end && (*q == 'e' || *q == 'E')) {
        q++;
        int sign = 1, e = 0;
        if (q < end && (*q == '+' || *q == '-')) {
            sign = *q == '-' ? -1 : 1;
            q++;
        }
        for (; q < end && is_digit(*q); q++) {
            e = e * 10 + (*q - '0');
            if (e > 1000) {
                return 0;
            }
        }
        scale += sign * e;
    }
    if (q != end || digits > 19 || m > (1ULL << 53) || scale < -22 || scale > 22) {
        return 0;
    }
    double x = (double)m;
    x = scale < 0 ? x / tens[-scale] : x * tens[scale];
    *out = negative ? -x : x;
    return 1;
#else
    (void)p;
    (void)n;
    (void)out;
    return 0;
#endif
}

/* What the merge needs of a line scan_copy takes. */
typedef struct {
    const char *run, *name, *pass, *vhash;
    Py_ssize_t run_n, name_n, pass_n, vhash_n;
    long long step, attempt, process;
    double time;
    int has;
} Copy;

/* The line's fields (see above): 1 taken, 0 not. */
static int
scan_fields(const char *p, Py_ssize_t len, int max_depth, Copy *out)
{
    Cur c = {p, p + len};
    if (len < 2 || *c.p != '{') {
        return 0;
    }
    c.p++;
    out->has = 0;
    for (;;) {
        const char *k;
        Py_ssize_t kn;
        if (!string_at(&c, &k, &kn) || c.p >= c.end || *c.p != ':') {
            return 0;
        }
        c.p++;
        int f = field_of(k, kn);
        if (f != F_OTHER && (out->has & f)) {
            return 0; /* the same field twice: left to orjson (the last one counts) */
        }
        out->has |= f;
        const char *v = c.p;
        int ok = 0, is_float = 0;
        Py_ssize_t digits = 0;
        switch (f) {
        case F_RUN:
            ok = string_at(&c, &out->run, &out->run_n);
            break;
        case F_NAME:
            ok = string_at(&c, &out->name, &out->name_n) && out->name_n > 0;
            break;
        case F_PASS:
            ok = string_at(&c, &out->pass, &out->pass_n);
            break;
        case F_VHASH:
            ok = string_at(&c, &out->vhash, &out->vhash_n) && out->vhash_n > 0;
            break;
        case F_KIND: {
            const char *s;
            Py_ssize_t n;
            ok = string_at(&c, &s, &n) && n == 10 && memcmp(s, "replicated", 10) == 0;
            break;
        }
        case F_STEP:
            ok = scan_int(&c, &out->step);
            break;
        case F_PROCESS:
            ok = scan_int(&c, &out->process);
            break;
        case F_ATTEMPT:
            ok = scan_int(&c, &out->attempt) && out->attempt >= 0;
            break;
        case F_TIME: {
            /* A float with at most 17 digits, as Python writes one: both
               parsers round it exactly. */
            ok = scan_number(&c, &is_float, &digits) && is_float && digits <= 17;
            if (ok) {
                char buf[64];
                Py_ssize_t n = c.p - v;
                if (n >= (Py_ssize_t)sizeof(buf)) {
                    return 0;
                }
                if (exact_double(v, n, &out->time)) {
                    break;
                }
                memcpy(buf, v, (size_t)n);
                buf[n] = '\0';
                char *after = NULL;
                out->time = PyOS_string_to_double(buf, &after, NULL);
                if (out->time == -1.0 && PyErr_Occurred()) {
                    PyErr_Clear();
                    return 0;
                }
                ok = after == buf + n;
            }
            break;
        }
        case F_DEVICES:
        case F_PROCESSES:
            ok = scan_holders(&c);
            break;
        case F_INDEX:
            return 0;
        default:
            ok = scan_value(&c, max_depth - 1);
        }
        if (!ok || c.p >= c.end) {
            return 0;
        }
        if (*c.p == '}') {
            c.p++;
            break;
        }
        if (*c.p != ',') {
            return 0;
        }
        c.p++;
    }
    return c.p == c.end && (out->has & F_NEEDED) == F_NEEDED;
}

/* The run and name strs scan_copy built last (they repeat from copy to
   copy): reused, so a copy's key costs no new str and its strs' hashes are
   known. Holds a reference to each (a few short strs, for the process's
   life). */
#define STR_CACHE 16
static PyObject *str_cache[STR_CACHE];
static unsigned str_next;

static PyObject *
ascii_str(const char *s, Py_ssize_t n)
{
    for (int j = 0; j < STR_CACHE; j++) {
        PyObject *o = str_cache[j];
        if (o != NULL && PyUnicode_GET_LENGTH(o) == n && memcmp(PyUnicode_DATA(o), s, (size_t)n) == 0) {
            Py_INCREF(o);
            return o;
        }
    }
    PyObject *o = PyUnicode_DecodeASCII(s, n, NULL);
    if (o != NULL) {
        Py_INCREF(o);
        Py_XSETREF(str_cache[str_next], o);
        str_next = (str_next + 1) % STR_CACHE;
    }
    return o;
}

/* ``line`` when it is a likely copy scan_copy can answer for: *marker
   (line, time, ((record_key, vhash), process)), the form time_keys takes,
   and ``seen`` updated as set_aside does. 1 taken, 0 not (the line goes
   to orjson), -1 error. */
static int
scan_copy(PyObject *line, PyObject *seen, Py_ssize_t max_depth, PyObject **marker)
{
    Copy f;
    const char *p = PyBytes_AS_STRING(line);
    if (!scan_fields(p, PyBytes_GET_SIZE(line), (int)max_depth, &f)) {
        return 0;
    }
    PyObject *run = ascii_str(f.run, f.run_n);
    PyObject *name = ascii_str(f.name, f.name_n);
    PyObject *step = PyLong_FromLongLong(f.step);
    PyObject *pass = (f.has & F_PASS) ? PyUnicode_DecodeASCII(f.pass, f.pass_n, NULL)
                                      : (Py_INCREF(k_forward), k_forward);
    PyObject *attempt = (f.has & F_ATTEMPT) ? PyLong_FromLongLong(f.attempt)
                                            : (Py_INCREF(zero), zero);
    PyObject *vhash = PyUnicode_DecodeASCII(f.vhash, f.vhash_n, NULL);
    PyObject *proc = PyLong_FromLongLong(f.process);
    PyObject *key = NULL, *rk = NULL, *info = NULL;
    int taken = -1;
    if (run == NULL || name == NULL || step == NULL || pass == NULL || attempt == NULL ||
        vhash == NULL || proc == NULL) {
        goto done;
    }
    key = PyTuple_Pack(6, run, name, step, pass, Py_None, attempt);
    rk = key == NULL ? NULL : PyTuple_Pack(2, key, vhash);
    if (rk == NULL) {
        goto done;
    }
    PyObject *got = PyDict_SetDefault(seen, rk, proc);
    if (got == NULL) {
        goto done;
    }
    Py_INCREF(got);
    PyObject *ne = PyObject_RichCompare(got, proc, Py_NE);
    Py_DECREF(got);
    int other = ne == NULL ? -1 : PyObject_IsTrue(ne);
    Py_XDECREF(ne);
    if (other <= 0) {
        taken = other;
        goto done;
    }
    info = PyTuple_Pack(2, rk, proc);
    PyObject *t = info == NULL ? NULL : PyFloat_FromDouble(f.time);
    if (t == NULL) {
        goto done;
    }
    *marker = PyTuple_Pack(3, line, t, info);
    Py_DECREF(t);
    taken = *marker == NULL ? -1 : 1;
done:
    Py_XDECREF(run);
    Py_XDECREF(name);
    Py_XDECREF(step);
    Py_XDECREF(pass);
    Py_XDECREF(attempt);
    Py_XDECREF(vhash);
    Py_XDECREF(proc);
    Py_XDECREF(key);
    Py_XDECREF(rk);
    Py_XDECREF(info);
    return taken;
}

/* plain_records(lines, loads, decode_error, max_depth, max_line, id_ranges[, seen])
   -> (records, slow): records[i] what loads made of lines[i] where that is
   a plainly valid record, else None with i in slow (ascending). With
   ``seen`` (a merge's, see set_aside), a likely copy scan_copy can answer
   for is records[i] = (line, time, info) instead, which time_keys takes. */
static PyObject *
plain_records(PyObject *self, PyObject *args)
{
    PyObject *lines, *loads, *decode_error, *id_ranges, *seen = Py_None;
    Py_ssize_t max_depth, max_line;
    if (!PyArg_ParseTuple(args, "O!OOnnO|O:plain_records", &PyList_Type, &lines, &loads,
                          &decode_error, &max_depth, &max_line, &id_ranges, &seen)) {
        return NULL;
    }
    if (seen != Py_None && !PyDict_CheckExact(seen)) {
        PyErr_SetString(PyExc_TypeError, "plain_records: seen is a dict or None");
        return NULL;
    }
    if (max_depth > 10000) {
        max_depth = 10000; /* scan_value's recursion: parse.MAX_DEPTH is far below */
    }
    Py_ssize_t n = PyList_GET_SIZE(lines);
    PyObject *records = PyList_New(n);
    PyObject *slow = PyList_New(0);
    if (records == NULL || slow == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i >= PyList_GET_SIZE(lines)) { /* loads or id_ranges shortened it */
            PyErr_SetString(PyExc_RuntimeError, "plain_records: lines changed size");
            goto fail;
        }
        PyObject *line = PyList_GET_ITEM(lines, i);
        PyObject *d = NULL;
        if (PyBytes_CheckExact(line)) {
            Py_ssize_t len = PyBytes_GET_SIZE(line);
            if (len <= max_line && (len <= max_depth ||
                                    openers(PyBytes_AS_STRING(line), len, max_depth) <= max_depth)) {
                if (seen != Py_None) {
                    /* Held: a process in ``seen`` may run Python code
                       (its comparison) that changes ``lines``. */
                    Py_INCREF(line);
                    int got = scan_copy(line, seen, max_depth, &d);
                    Py_DECREF(line);
                    if (got < 0) {
                        goto fail;
                    }
                    if (got) {
                        PyList_SET_ITEM(records, i, d);
                        continue;
                    }
                }
                Py_INCREF(line);
                d = PyObject_CallOneArg(loads, line);
                Py_DECREF(line);
                if (d == NULL) {
                    if (!PyErr_ExceptionMatches(decode_error)) {
                        goto fail;
                    }
                    PyErr_Clear();
                }
                else {
                    int ok = plain(d, id_ranges);
                    if (ok < 0) {
                        Py_DECREF(d);
                        goto fail;
                    }
                    if (!ok) {
                        Py_CLEAR(d);
                    }
                }
            }
        }
        if (d == NULL) {
            PyObject *at = PyLong_FromSsize_t(i);
            if (at == NULL || PyList_Append(slow, at) < 0) {
                Py_XDECREF(at);
                goto fail;
            }
            Py_DECREF(at);
            Py_INCREF(Py_None);
            d = Py_None;
        }
        PyList_SET_ITEM(records, i, d);
    }
    PyObject *out = PyTuple_Pack(2, records, slow);
    Py_DECREF(records);
    Py_DECREF(slow);
    return out;
fail:
    Py_XDECREF(records);
    Py_XDECREF(slow);
    return NULL;
}

/* format.record_key(d): built here for a record without an ``index`` (the
   tuple record_key builds then: run, name, step, pass or "forward", None,
   attempt or 0), record_key itself called for any other. */
static PyObject *
key_of(PyObject *d, PyObject *record_key)
{
    int err = 0;
    PyObject *index = get(d, k_index, &err);
    if (err) {
        return NULL;
    }
    if (index != NULL || !PyDict_CheckExact(d)) {
        return PyObject_CallOneArg(record_key, d);
    }
    PyObject *run = get(d, k_run, &err);
    PyObject *name = get(d, k_name, &err);
    PyObject *step = get(d, k_step, &err);
    PyObject *pass = get(d, k_pass, &err);
    PyObject *attempt = get(d, k_attempt, &err);
    if (err) {
        return NULL;
    }
    return PyTuple_Pack(6, run ? run : Py_None, name ? name : Py_None, step ? step : Py_None,
                        pass ? pass : k_forward, Py_None, attempt ? attempt : zero);
}

/* time_keys for one record (None for a line that is none): moves *t (a
   reference the caller owns) to the record's time where that is later, and
   returns its info, a new reference; NULL on error. */
static PyObject *
record_part(PyObject *d, PyObject **t, PyObject *record_key)
{
    if (d == Py_None) {
        Py_RETURN_NONE;
    }
    if (!PyDict_Check(d)) {
        PyErr_SetString(PyExc_TypeError, "time_keys: a record is not a dict");
        return NULL;
    }
    int err = 0;
    PyObject *tt = get(d, k_time, &err);
    if (err) {
        return NULL;
    }
    if (tt != NULL && PyFloat_CheckExact(tt)) {
        if (PyFloat_AS_DOUBLE(tt) > PyFloat_AS_DOUBLE(*t)) {
            Py_INCREF(tt);
            Py_SETREF(*t, tt);
        }
    }
    else if (tt != NULL && PyLong_CheckExact(tt)) {
        int greater = PyObject_RichCompareBool(tt, *t, Py_GT);
        if (greater < 0) {
            return NULL;
        }
        if (greater) {
            double x = PyLong_AsDouble(tt);
            if (x == -1.0 && PyErr_Occurred()) {
                return NULL;
            }
            PyObject *f = PyFloat_FromDouble(x);
            if (f == NULL) {
                return NULL;
            }
            Py_SETREF(*t, f);
        }
    }
    PyObject *kind = get(d, k_kind, &err);
    PyObject *vhash = get(d, k_vhash, &err);
    if (err) {
        return NULL;
    }
    if (kind == NULL || vhash == NULL) {
        Py_RETURN_NONE;
    }
    /* Held: the comparison, the truth test and record_key may run Python
       code that changes d. */
    Py_INCREF(vhash);
    PyObject *info = NULL;
    int eq = PyObject_RichCompareBool(kind, k_replicated, Py_EQ);
    int truth = eq > 0 ? PyObject_IsTrue(vhash) : 0;
    if (eq < 0 || truth < 0) {
        goto done;
    }
    if (!truth) {
        info = Py_None;
        Py_INCREF(info);
        goto done;
    }
    PyObject *proc = get(d, k_process, &err);
    if (err) {
        goto done;
    }
    proc = proc == NULL ? Py_None : proc;
    Py_INCREF(proc);
    PyObject *rk = key_of(d, record_key);
    PyObject *key = rk == NULL ? NULL : PyTuple_Pack(2, rk, vhash);
    Py_XDECREF(rk);
    if (key != NULL) {
        info = PyTuple_Pack(2, key, proc);
        Py_DECREF(key);
    }
    Py_DECREF(proc);
done:
    Py_DECREF(vhash);
    return info;
}

/* A replicated record that another process's copy came before, in the
   order the pieces are read (``seen``: (record_key, vhash) -> the process
   of the first copy read): a copy the merge will most likely drop (it keeps
   the first copy in merged order, and every copy of that copy's process),
   so it is held as its line (records[i] = lines[i]) and the record freed
   now, while it is in the cache; merge_round parses the line again in the
   rare case it keeps it. 0, or -1 with an exception. */
static int
set_aside(PyObject *records, Py_ssize_t i, PyObject *lines, PyObject *seen, PyObject *info)
{
    if (i >= PyList_GET_SIZE(lines) || i >= PyList_GET_SIZE(records)) {
        return 0;
    }
    PyObject *line = PyList_GET_ITEM(lines, i);
    if (!PyBytes_CheckExact(line)) {
        return 0;
    }
    PyObject *proc = PyTuple_GET_ITEM(info, 1);
    PyObject *got = PyDict_SetDefault(seen, PyTuple_GET_ITEM(info, 0), proc);
    if (got == NULL) {
        return -1;
    }
    Py_INCREF(got);
    PyObject *ne = PyObject_RichCompare(got, proc, Py_NE);
    Py_DECREF(got);
    int other = ne == NULL ? -1 : PyObject_IsTrue(ne);
    Py_XDECREF(ne);
    if (other <= 0) {
        return other;
    }
    if (i >= PyList_GET_SIZE(records) || i >= PyList_GET_SIZE(lines)) {
        return 0; /* changed by the comparison's Python code: leave it */
    }
    line = PyList_GET_ITEM(lines, i);
    if (!PyBytes_CheckExact(line)) {
        return 0;
    }
    Py_INCREF(line);
    return PyList_SetItem(records, i, line); /* frees the record */
}

/* time_keys(records, t, keys, infos, record_key[, lines, seen]) -> t: for each record
   (None for a line that is none), append to ``keys`` the running largest
   record time (a time that is no int or float counts as none: runs._Source
   .extend's loop), and to ``infos`` what merge_round needs of it, taken
   now while the record is fresh in the cache: ((record_key, vhash),
   process) for a replicated record with a vhash, else None. With
   ``lines`` (each record's line) and ``seen`` (shared by the merge's
   sources), a likely copy is held as its line (set_aside). */
static PyObject *
time_keys(PyObject *self, PyObject *args)
{
    PyObject *records, *t, *keys, *infos, *record_key, *lines = Py_None, *seen = Py_None;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O|OO:time_keys", &PyList_Type, &records, &PyFloat_Type,
                          &t, &PyList_Type, &keys, &PyList_Type, &infos, &record_key, &lines,
                          &seen)) {
        return NULL;
    }
    if (lines != Py_None && (!PyList_CheckExact(lines) || !PyDict_CheckExact(seen))) {
        PyErr_SetString(PyExc_TypeError, "time_keys: lines is a list, seen a dict");
        return NULL;
    }
    Py_INCREF(t);
    /* The size read at each step, as Python's ``for d in records`` does, and
       each record held while it is used: record_key is Python code. */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(records); i++) {
        PyObject *d = PyList_GET_ITEM(records, i);
        if (PyTuple_CheckExact(d)) {
            /* A copy plain_records read without building it: (line, time,
               info). Held as its line, as set_aside holds one. */
            if (PyTuple_GET_SIZE(d) != 3 || !PyBytes_CheckExact(PyTuple_GET_ITEM(d, 0)) ||
                !PyFloat_CheckExact(PyTuple_GET_ITEM(d, 1))) {
                PyErr_SetString(PyExc_TypeError, "time_keys: a copy is (line, time, info)");
                goto fail;
            }
            PyObject *line = PyTuple_GET_ITEM(d, 0), *tt = PyTuple_GET_ITEM(d, 1);
            PyObject *info = PyTuple_GET_ITEM(d, 2);
            if (PyFloat_AS_DOUBLE(tt) > PyFloat_AS_DOUBLE(t)) {
                Py_INCREF(tt);
                Py_SETREF(t, tt);
            }
            Py_INCREF(line);
            Py_INCREF(info);
            int bad = PyList_SetItem(records, i, line) < 0; /* frees the tuple */
            bad = bad || PyList_Append(keys, t) < 0 || PyList_Append(infos, info) < 0;
            Py_DECREF(info);
            if (bad) {
                goto fail;
            }
            continue;
        }
        Py_INCREF(d);
        PyObject *info = record_part(d, &t, record_key);
        Py_DECREF(d);
        if (info == NULL) {
            goto fail;
        }
        if (lines != Py_None && PyTuple_CheckExact(info) &&
            set_aside(records, i, lines, seen, info) < 0) {
            Py_DECREF(info);
            goto fail;
        }
        int bad = PyList_Append(keys, t) < 0 || PyList_Append(infos, info) < 0;
        Py_DECREF(info);
        if (bad) {
            goto fail;
        }
    }
    return t;
fail:
    Py_DECREF(t);
    return NULL;
}

/* One record of a merge round: its key, and where it is. */
typedef struct {
    double key;
    Py_ssize_t seq; /* in the round, slices laid out in source order */
    Py_ssize_t part;
    Py_ssize_t at;
} Taken;

static int
taken_order(const void *a, const void *b)
{
    const Taken *x = a, *y = b;
    if (x->key < y->key) {
        return -1;
    }
    if (x->key > y->key) {
        return 1;
    }
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

/* A part of merge_round, (records, keys, infos, p, cut): its slice into *p
   and *cut, checked against its lists. 0, or -1 with TypeError (not that
   form: ints, not any object with __index__, which would run Python code)
   or ValueError (outside its lists). */
static int
part_slice(PyObject *part, Py_ssize_t *p, Py_ssize_t *cut)
{
    if (!PyTuple_Check(part) || PyTuple_GET_SIZE(part) != 5 ||
        !PyList_Check(PyTuple_GET_ITEM(part, 0)) || !PyList_Check(PyTuple_GET_ITEM(part, 1)) ||
        !PyList_Check(PyTuple_GET_ITEM(part, 2)) || !PyLong_Check(PyTuple_GET_ITEM(part, 3)) ||
        !PyLong_Check(PyTuple_GET_ITEM(part, 4))) {
        PyErr_SetString(PyExc_TypeError,
                        "merge_round: a part is (records, keys, infos, p, cut): 3 lists, 2 ints");
        return -1;
    }
    *p = PyLong_AsSsize_t(PyTuple_GET_ITEM(part, 3));
    if (*p == -1 && PyErr_Occurred()) {
        return -1;
    }
    *cut = PyLong_AsSsize_t(PyTuple_GET_ITEM(part, 4));
    if (*cut == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (*p < 0 || *cut < *p || *cut > PyList_GET_SIZE(PyTuple_GET_ITEM(part, 0)) ||
        *cut > PyList_GET_SIZE(PyTuple_GET_ITEM(part, 1)) ||
        *cut > PyList_GET_SIZE(PyTuple_GET_ITEM(part, 2))) {
        PyErr_SetString(PyExc_ValueError, "merge_round: a slice outside its source");
        return -1;
    }
    return 0;
}

/* One record of the round in merged order (d and info held by the
   caller): out, or dropped as a copy, or None and its problem. 0, -1 error. */
static int
take(PyObject *out, PyObject *problems, PyObject *first, PyObject *d, PyObject *info,
     Py_ssize_t *pos, PyObject *loads)
{
    if (PyTuple_CheckExact(info)) {
        if (PyTuple_GET_SIZE(info) != 2) {
            PyErr_SetString(PyExc_TypeError,
                            "merge_round: an info is ((record_key, vhash), process)");
            return -1;
        }
        PyObject *proc = PyTuple_GET_ITEM(info, 1);
        PyObject *got = PyDict_SetDefault(first, PyTuple_GET_ITEM(info, 0), proc);
        if (got == NULL) {
            return -1;
        }
        /* first.setdefault(...) != proc, as Python says it: no identity
           shortcut (a NaN process is no process, there as here). */
        Py_INCREF(got);
        PyObject *ne = PyObject_RichCompare(got, proc, Py_NE);
        Py_DECREF(got);
        int other = ne == NULL ? -1 : PyObject_IsTrue(ne);
        Py_XDECREF(ne);
        if (other) {
            return other < 0 ? -1 : 0; /* the same value from another process: one copy */
        }
    }
    *pos += 1;
    if (info != Py_None && !PyTuple_CheckExact(info)) {
        PyObject *why = PyObject_GetAttr(info, k_why);
        PyObject *where = why == NULL ? NULL : PyLong_FromSsize_t(*pos);
        int bad = where == NULL || PyDict_SetItem(problems, where, why) < 0;
        Py_XDECREF(why);
        Py_XDECREF(where);
        return bad ? -1 : PyList_Append(out, Py_None);
    }
    if (PyBytes_CheckExact(d)) {
        /* A copy set aside as its line (set_aside) that goes out after all:
           the line again, parsed as it was the first time. */
        if (loads == Py_None) {
            PyErr_SetString(PyExc_TypeError, "merge_round: a line set aside and no loads");
            return -1;
        }
        PyObject *r = PyObject_CallOneArg(loads, d);
        if (r == NULL) {
            return -1;
        }
        int bad = PyList_Append(out, r);
        Py_DECREF(r);
        return bad;
    }
    return PyList_Append(out, d);
}

/* merge_round(parts, first, pos[, loads]) -> (out, problems, pos): one round of
   runs._merge. ``parts``: (records, keys, infos, p, cut) of each source
   taking part, in source order; its records [p, cut) go out sorted by key,
   ties in the order the slices are laid out (Python's stable sort of the
   concatenated slices), each replicated value kept from the first process
   that wrote it (``first``: (record_key, vhash) -> that process), a line
   that is no record as None with its problem (an info that is a _Bad: its
   ``why``) at its position, a line set aside by time_keys that goes out
   after all parsed again by ``loads``. Only the records that go out are
   touched (one reference each): a round's records are all over memory. */
static PyObject *
merge_round(PyObject *self, PyObject *args)
{
    PyObject *parts_arg, *first, *loads = Py_None;
    Py_ssize_t pos;
    if (!PyArg_ParseTuple(args, "O!O!n|O:merge_round", &PyList_Type, &parts_arg, &PyDict_Type,
                          &first, &pos, &loads)) {
        return NULL;
    }
    /* The parts held for the round (so are their lists): the last loop may
       run Python code (a key's hash or comparison, a problem's ``why``). */
    PyObject *parts = PyList_AsTuple(parts_arg);
    if (parts == NULL) {
        return NULL;
    }
    Py_ssize_t nparts = PyTuple_GET_SIZE(parts);
    Py_ssize_t total = 0;
    Taken *taken = NULL;
    PyObject *out = NULL, *problems = NULL;
    for (Py_ssize_t j = 0; j < nparts; j++) {
        Py_ssize_t p, cut;
        if (part_slice(PyTuple_GET_ITEM(parts, j), &p, &cut) < 0) {
            goto fail;
        }
        if (total > PY_SSIZE_T_MAX - (cut - p)) {
            PyErr_NoMemory();
            goto fail;
        }
        total += cut - p;
    }
    /* No Python code runs from the checks above to the sort: the slices
       are still inside their lists. */
    taken = PyMem_New(Taken, total ? total : 1);
    if (taken == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    Py_ssize_t seq = 0;
    for (Py_ssize_t j = 0; j < nparts; j++) {
        PyObject *part = PyTuple_GET_ITEM(parts, j);
        PyObject *keys = PyTuple_GET_ITEM(part, 1);
        Py_ssize_t p = PyLong_AsSsize_t(PyTuple_GET_ITEM(part, 3));
        Py_ssize_t cut = PyLong_AsSsize_t(PyTuple_GET_ITEM(part, 4));
        for (Py_ssize_t at = p; at < cut; at++) {
            PyObject *k = PyList_GET_ITEM(keys, at);
            if (!PyFloat_CheckExact(k)) {
                PyErr_SetString(PyExc_TypeError, "merge_round: a key is not a float");
                goto fail;
            }
            taken[seq] = (Taken){PyFloat_AS_DOUBLE(k), seq, j, at};
            seq++;
        }
    }
    qsort(taken, (size_t)total, sizeof(Taken), taken_order);
    out = PyList_New(0);
    problems = PyDict_New();
    if (out == NULL || problems == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < total; i++) {
        PyObject *part = PyTuple_GET_ITEM(parts, taken[i].part);
        PyObject *records = PyTuple_GET_ITEM(part, 0), *infos = PyTuple_GET_ITEM(part, 2);
        Py_ssize_t at = taken[i].at;
        if (at >= PyList_GET_SIZE(records) || at >= PyList_GET_SIZE(infos)) {
            PyErr_SetString(PyExc_RuntimeError, "merge_round: a source changed during the round");
            goto fail;
        }
        PyObject *d = PyList_GET_ITEM(records, at);
        PyObject *info = PyList_GET_ITEM(infos, at);
        Py_INCREF(d);
        Py_INCREF(info);
        int bad = take(out, problems, first, d, info, &pos, loads) < 0;
        if (!bad && at < PyList_GET_SIZE(records) && PyList_GET_ITEM(records, at) == d) {
            /* The source lets go of it (its slot is dropped with the next
               piece anyway): a record that goes out lives as long as the
               consumer keeps it, and is freed when it lets go, while it
               is still in the cache; a copy dropped here goes now. */
            Py_INCREF(Py_None);
            bad = PyList_SetItem(records, at, Py_None) < 0;
        }
        Py_DECREF(d);
        Py_DECREF(info);
        if (bad) {
            goto fail;
        }
    }
    PyMem_Free(taken);
    Py_DECREF(parts);
    return Py_BuildValue("(NNn)", out, problems, pos);
fail:
    PyMem_Free(taken);
    Py_DECREF(parts);
    Py_XDECREF(out);
    Py_XDECREF(problems);
    return NULL;
}

/* per_device_run(part, k, decoded, n_fields, dev_coords, masks, mask_devices,
   values, processes, last, last_vals, prev_proc)
   -> (k', taken, dups, last, last_vals, prev_proc)

   summary_batch.BatchSummarizer._add_part's loop over a run of the
   simplest usual per-device records, from part[k] on: a dict of exactly
   ``n_fields`` fields whose value is a finite float or an int, step an
   int, process a scalar, dtype/shape/time/host present, kind
   "per_device", an int device in [0, mask_devices) at its usual
   coordinates (dev_coords[device], equal; one axis, an int). It stops at
   the first other record (k' its index), which the Python loop takes, as
   it takes every record when this module is not built. Updates ``masks``
   (step -> bits of its devices; a device already there is a duplicate),
   ``values``, ``processes`` (a process added when it differs from the
   last record's, as the loop does), ``last`` / ``last_vals`` (the largest
   step and its values in order). */
static PyObject *
per_device_run(PyObject *self, PyObject *args)
{
    PyObject *part, *dev_coords, *masks, *values, *processes, *last, *last_vals, *prev_proc;
    Py_ssize_t k, n_fields, mask_devices;
    int decoded;
    if (!PyArg_ParseTuple(args, "O!npnO!O!nO!O!OO!O:per_device_run", &PyList_Type, &part, &k,
                          &decoded, &n_fields, &PyDict_Type, &dev_coords, &PyDict_Type, &masks,
                          &mask_devices, &PyList_Type, &values, &PySet_Type, &processes, &last,
                          &PyList_Type, &last_vals, &prev_proc)) {
        return NULL;
    }
    Py_INCREF(last);
    Py_INCREF(last_vals);
    Py_INCREF(prev_proc);
    Py_ssize_t taken = 0, dups = 0;
    PyObject *one = PyLong_FromLong(1);
    if (one == NULL) {
        goto fail;
    }
    for (; k >= 0 && k < PyList_GET_SIZE(part); k++) {
        PyObject *r = PyList_GET_ITEM(part, k);
        if (!PyDict_CheckExact(r) || PyDict_GET_SIZE(r) != n_fields) {
            break;
        }
        int err = 0;
        PyObject *v = get(r, k_value, &err), *step = get(r, k_step, &err);
        PyObject *kind = get(r, k_kind, &err), *proc = get(r, k_process, &err);
        PyObject *dev = get(r, k_device, &err), *coords = get(r, k_coords, &err);
        if (err) {
            goto fail;
        }
        if (v == NULL || step == NULL || kind == NULL || proc == NULL || dev == NULL ||
            coords == NULL) {
            break;
        }
        if (!(PyLong_CheckExact(v) ||
              (PyFloat_CheckExact(v) && (!decoded || isfinite(PyFloat_AS_DOUBLE(v))))) ||
            !PyLong_CheckExact(step) || !is_scalar(proc) || !PyUnicode_CheckExact(kind) ||
            PyUnicode_Compare(kind, k_per_device) != 0 || !PyLong_CheckExact(dev) ||
            !PyDict_CheckExact(coords) || PyDict_GET_SIZE(coords) != 1) {
            break;
        }
        PyObject *must[] = {k_dtype, k_shape, k_time, k_host};
        int missing = 0;
        for (size_t j = 0; j < 4 && !missing; j++) {
            int has = PyDict_Contains(r, must[j]);
            if (has < 0) {
                goto fail;
            }
            missing = !has;
        }
        if (missing) {
            break;
        }
        int overflow = 0;
        long d = PyLong_AsLongAndOverflow(dev, &overflow);
        if (d == -1 && PyErr_Occurred()) {
            goto fail;
        }
        if (overflow || d < 0 || d >= mask_devices) {
            break;
        }
        Py_ssize_t at = 0;
        PyObject *axis, *c;
        PyDict_Next(coords, &at, &axis, &c);
        if (!PyLong_CheckExact(c)) {
            break;
        }
        /* Held from here: the comparisons below may run Python code. */
        Py_INCREF(r);
        PyObject *usual = PyDict_GetItemWithError(dev_coords, dev);
        int same = usual == NULL ? (PyErr_Occurred() ? -1 : 0)
                                 : PyObject_RichCompareBool(coords, usual, Py_EQ);
        if (same <= 0) {
            Py_DECREF(r);
            if (same < 0) {
                goto fail;
            }
            break;
        }
        /* The device's bit in its step's mask. */
        PyObject *bit = PyNumber_Lshift(one, dev);
        PyObject *mask = bit == NULL ? NULL : PyDict_GetItemWithError(masks, step);
        if (bit == NULL || (mask == NULL && PyErr_Occurred())) {
            Py_XDECREF(bit);
            Py_DECREF(r);
            goto fail;
        }
        int dup = 0;
        if (mask != NULL) {
            PyObject *both = PyNumber_And(mask, bit);
            dup = both == NULL ? -1 : PyObject_IsTrue(both);
            Py_XDECREF(both);
        }
        if (dup == 0) {
            PyObject *grown = mask == NULL ? (Py_INCREF(bit), bit) : PyNumber_Or(mask, bit);
            dup = grown == NULL ? -1 : PyDict_SetItem(masks, step, grown);
            Py_XDECREF(grown);
        }
        else if (dup > 0) {
            dups++;
            dup = 0;
        }
        Py_DECREF(bit);
        if (dup < 0) {
            Py_DECREF(r);
            goto fail;
        }
        /* What every usual record adds. */
        taken++;
        if (proc != prev_proc) {
            if (PySet_Add(processes, proc) < 0) {
                Py_DECREF(r);
                goto fail;
            }
            Py_INCREF(proc);
            Py_SETREF(prev_proc, proc);
        }
        int later = last == Py_None ? 1 : PyObject_RichCompareBool(step, last, Py_GT);
        int equal = later == 0 ? PyObject_RichCompareBool(step, last, Py_EQ) : 0;
        if (later < 0 || equal < 0) {
            Py_DECREF(r);
            goto fail;
        }
        if (later) {
            PyObject *fresh = PyList_New(1);
            if (fresh == NULL) {
                Py_DECREF(r);
                goto fail;
            }
            Py_INCREF(v);
            PyList_SET_ITEM(fresh, 0, v);
            Py_INCREF(step);
            Py_SETREF(last, step);
            Py_SETREF(last_vals, fresh);
        }
        else if (equal && PyList_Append(last_vals, v) < 0) {
            Py_DECREF(r);
            goto fail;
        }
        int bad = PyList_Append(values, v) < 0;
        Py_DECREF(r);
        if (bad) {
            goto fail;
        }
    }
    Py_DECREF(one);
    return Py_BuildValue("(nnnNNN)", k, taken, dups, last, last_vals, prev_proc);
fail:
    Py_XDECREF(one);
    Py_DECREF(last);
    Py_DECREF(last_vals);
    Py_DECREF(prev_proc);
    return NULL;
}

/* All of ``ids`` (a list) exact ints, or None where ``none_ok``. */
static int
all_ints(PyObject *ids, int none_ok)
{
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(ids); j++) {
        PyObject *x = PyList_GET_ITEM(ids, j);
        if (!(PyLong_CheckExact(x) || (none_ok && x == Py_None))) {
            return 0;
        }
    }
    return 1;
}

/* scalar_clean(d, not_clean) -> bool: whether checks.schema_problems(d)
   finds nothing by its first, fast path: no field of ``not_clean``
   (format.NOT_CLEAN), checks._fields_clean(d), and a float or int value
   of a "float..."/"bfloat..." dtype with shape []. False means "run
   schema_problems", which gives the answer (``validate`` of a record that
   readers already took: format.validate_dict's types hold). */
static int clean_record(PyObject *d, PyObject *not_clean);

static PyObject *
scalar_clean(PyObject *self, PyObject *args)
{
    PyObject *d, *not_clean;
    if (!PyArg_ParseTuple(args, "O!O:scalar_clean", &PyDict_Type, &d, &not_clean)) {
        return NULL;
    }
    int clean = clean_record(d, not_clean);
    if (clean < 0) {
        return NULL;
    }
    return PyBool_FromLong(clean);
}

/* scalar_clean for a dict: 1, 0, or -1 with an exception. */
static int
clean_record(PyObject *d, PyObject *not_clean)
{
    int found = 0;
    if (PyTuple_CheckExact(not_clean)) {
        /* The form the callers keep (checks.py): no iterator a record. */
        for (Py_ssize_t j = 0; !found && j < PyTuple_GET_SIZE(not_clean); j++) {
            found = PyDict_Contains(d, PyTuple_GET_ITEM(not_clean, j));
        }
        if (found < 0) {
            return -1;
        }
    }
    else {
        PyObject *it = PyObject_GetIter(not_clean);
        if (it == NULL) {
            return -1;
        }
        PyObject *name;
        while (!found && (name = PyIter_Next(it)) != NULL) {
            found = PyDict_Contains(d, name);
            Py_DECREF(name);
        }
        Py_DECREF(it);
        if (found < 0 || PyErr_Occurred()) {
            return -1;
        }
    }
    if (found) {
        return 0;
    }
    int err = 0;
    PyObject *step = get(d, k_step, &err), *process = get(d, k_process, &err);
    PyObject *t = get(d, k_time, &err), *host = get(d, k_host, &err);
    PyObject *divergent = get(d, k_divergent, &err), *pass = get(d, k_pass, &err);
    PyObject *kind = get(d, k_kind, &err), *value = get(d, k_value, &err);
    PyObject *dtype = get(d, k_dtype, &err), *shape = get(d, k_shape, &err);
    if (err) {
        return -1;
    }
    if (step == NULL || process == NULL || t == NULL || host == NULL || kind == NULL ||
        value == NULL || dtype == NULL || shape == NULL) {
        return 0;
    }
    /* _fields_clean's common part; step <= MAX_STEP (2**63 - 1): fits a
       long long. */
    int overflow = 0;
    long long st = PyLong_CheckExact(step) ? PyLong_AsLongLongAndOverflow(step, &overflow) : -1;
    if (st == -1 && PyErr_Occurred()) {
        return -1;
    }
    long long pr =
        PyLong_CheckExact(process) ? PyLong_AsLongLongAndOverflow(process, &overflow) : -1;
    if (pr == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow || st < 0 || pr < 0 || !PyFloat_CheckExact(t) ||
        !isfinite(PyFloat_AS_DOUBLE(t)) || !PyUnicode_CheckExact(host) ||
        (divergent != NULL && divergent != Py_True) || (pass != NULL && !PyUnicode_CheckExact(pass)) ||
        !PyUnicode_CheckExact(kind)) {
        return 0;
    }
    if (PyUnicode_Compare(kind, k_per_device) == 0) {
        PyObject *device = get(d, k_device, &err), *coords = get(d, k_coords, &err);
        if (err) {
            return -1;
        }
        if (device == NULL || coords == NULL || !(device == Py_None || PyLong_CheckExact(device)) ||
            !PyDict_CheckExact(coords)) {
            return 0;
        }
        Py_ssize_t at = 0;
        PyObject *axis, *c;
        while (PyDict_Next(coords, &at, &axis, &c)) {
            if (!PyLong_CheckExact(c)) {
                return 0;
            }
        }
    }
    else if (PyUnicode_Compare(kind, k_replicated) == 0) {
        PyObject *replicas = get(d, k_replicas, &err), *devices = get(d, k_devices, &err);
        PyObject *processes = get(d, k_processes, &err), *vhash = get(d, k_vhash, &err);
        if (err) {
            return -1;
        }
        if (replicas == NULL || !PyLong_CheckExact(replicas)) {
            return 0;
        }
        long long n = PyLong_AsLongLongAndOverflow(replicas, &overflow);
        if (n == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (overflow || n < 1) {
            return 0;
        }
        if (devices != NULL && devices != Py_None &&
            !(PyList_CheckExact(devices) && PyList_GET_SIZE(devices) == n && all_ints(devices, 1))) {
            return 0;
        }
        if (processes != NULL && !(PyList_CheckExact(processes) && all_ints(processes, 0))) {
            return 0;
        }
        if (vhash != NULL && !PyUnicode_CheckExact(vhash)) {
            return 0;
        }
    }
    else if (PyUnicode_Compare(kind, k_meta) != 0) {
        return 0;
    }
    /* schema_problems' fast return: a float or int scalar of a float dtype. */
    if (!PyUnicode_CheckExact(dtype) || !PyList_CheckExact(shape) || PyList_GET_SIZE(shape) != 0 ||
        !(PyFloat_CheckExact(value) || PyLong_CheckExact(value))) {
        return 0;
    }
    if (PyUnicode_Tailmatch(dtype, k_float, 0, PY_SSIZE_T_MAX, -1) == 1 ||
        PyUnicode_Tailmatch(dtype, k_bfloat, 0, PY_SSIZE_T_MAX, -1) == 1) {
        return 1;
    }
    return 0;
}

/* validate_run's cache: ``cache[device]`` is (group, steps) of the last
   record of that device filed; its steps (a new reference, into *steps)
   when this record's group is that one (the same run, name, pass and
   coordinate: the tuple equality the groups dict would test), else
   *steps NULL. 0, or -1 with an exception. */
static int
cached_steps(PyObject *cache, PyObject *device, PyObject *run, PyObject *name, PyObject *pass,
             PyObject *axis, PyObject *c, PyObject **steps)
{
    *steps = NULL;
    PyObject *hit = PyDict_GetItemWithError(cache, device);
    if (hit == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    if (!PyTuple_CheckExact(hit) || PyTuple_GET_SIZE(hit) != 2) {
        return 0;
    }
    Py_INCREF(hit); /* the comparisons below may run Python code */
    PyObject *group = PyTuple_GET_ITEM(hit, 0), *found = PyTuple_GET_ITEM(hit, 1);
    int same = PyTuple_CheckExact(group) && PyTuple_GET_SIZE(group) == 8 &&
               PyDict_CheckExact(found);
    if (same) {
        PyObject *ckey = PyTuple_GET_ITEM(group, 7);
        PyObject *item = PyTuple_CheckExact(ckey) && PyTuple_GET_SIZE(ckey) == 1
                             ? PyTuple_GET_ITEM(ckey, 0) : NULL;
        same = item != NULL && PyTuple_CheckExact(item) && PyTuple_GET_SIZE(item) == 2;
        PyObject *pairs[][2] = {
            {PyTuple_GET_ITEM(group, 6), device}, {PyTuple_GET_ITEM(group, 1), run},
            {PyTuple_GET_ITEM(group, 2), name},   {PyTuple_GET_ITEM(group, 3), pass},
            {same ? PyTuple_GET_ITEM(item, 0) : NULL, axis},
            {same ? PyTuple_GET_ITEM(item, 1) : NULL, c},
        };
        for (size_t j = 0; same > 0 && j < sizeof(pairs) / sizeof(pairs[0]); j++) {
            same = PyObject_RichCompareBool(pairs[j][0], pairs[j][1], Py_EQ);
        }
    }
    if (same > 0) {
        Py_INCREF(found);
        *steps = found;
    }
    Py_DECREF(hit);
    return same < 0 ? -1 : 0;
}

/* validate_run(batch, k, groups, not_clean[, cache]) -> (k', taken)

   checks._validate's loop over a run of the simplest records, from
   batch[k] on, when no later attempt is known (the caller passes only
   then): a per-device record without attempt, index or stored bytes that
   scalar_clean finds clean, one-axis int coordinates, and no earlier copy
   of its key (checks.FirstCopies, whose ``_keys`` is ``groups``: the
   record's line is filed under its duplicate_parts key). It stops at the
   first other record (k' its index; a duplicate is left unfiled), which
   the Python loop takes. ``taken``: the records it took. ``cache``: a dict
   the caller keeps for the pass beside ``groups`` (cached_steps): its
   entries are steps dicts of that ``groups``, never of another. */
static PyObject *
validate_run(PyObject *self, PyObject *args)
{
    PyObject *batch, *groups, *not_clean, *cache = Py_None;
    Py_ssize_t k, first_line;
    if (!PyArg_ParseTuple(args, "O!nnO!O|O:validate_run", &PyList_Type, &batch, &k, &first_line,
                          &PyDict_Type, &groups, &not_clean, &cache)) {
        return NULL;
    }
    if (cache != Py_None && !PyDict_CheckExact(cache)) {
        PyErr_SetString(PyExc_TypeError, "validate_run: cache is a dict or None");
        return NULL;
    }
    Py_ssize_t taken = 0;
    for (; k >= 0 && k < PyList_GET_SIZE(batch); k++) {
        PyObject *d = PyList_GET_ITEM(batch, k);
        if (!PyDict_CheckExact(d)) {
            break;
        }
        Py_INCREF(d);
        int err = 0;
        PyObject *kind = get(d, k_kind, &err), *attempt = get(d, k_attempt, &err);
        PyObject *index = get(d, k_index, &err), *coords = get(d, k_coords, &err);
        PyObject *device = get(d, k_device, &err);
        if (err) {
            Py_DECREF(d);
            return NULL;
        }
        if (kind == NULL || !PyUnicode_CheckExact(kind) ||
            PyUnicode_Compare(kind, k_per_device) != 0 || attempt != NULL || index != NULL ||
            coords == NULL || !PyDict_CheckExact(coords) || PyDict_GET_SIZE(coords) != 1 ||
            device == NULL) {
            Py_DECREF(d);
            break;
        }
        Py_ssize_t at = 0;
        PyObject *axis, *c;
        PyDict_Next(coords, &at, &axis, &c);
        if (!PyLong_CheckExact(c)) {
            Py_DECREF(d);
            break;
        }
        int clean = clean_record(d, not_clean);
        if (clean <= 0) {
            Py_DECREF(d);
            if (clean < 0) {
                return NULL;
            }
            break;
        }
        /* duplicate_parts(d): (("per_device", run, name, pass, index,
           attempt, device, coords_key), step), coords_key ((axis, c),). */
        PyObject *run = get(d, k_run, &err), *name = get(d, k_name, &err);
        PyObject *pass = get(d, k_pass, &err), *step = get(d, k_step, &err);
        if (err) {
            Py_DECREF(d);
            return NULL;
        }
        PyObject *steps = NULL;
        int dup = 0;
        if (cache != Py_None) {
            /* The steps of this device's group the last time, if the
               record is of that group still: no group tuple built and
               hashed a record (most of what this loop cost). */
            int same = cached_steps(cache, device, run ? run : Py_None, name ? name : Py_None,
                                    pass ? pass : k_forward, axis, c, &steps);
            if (same < 0) {
                Py_DECREF(d);
                return NULL;
            }
        }
        if (steps == NULL) {
            PyObject *item = PyTuple_Pack(2, axis, c);
            PyObject *ckey = item == NULL ? NULL : PyTuple_Pack(1, item);
            Py_XDECREF(item);
            PyObject *group =
                ckey == NULL ? NULL
                             : PyTuple_Pack(8, k_per_device, run ? run : Py_None,
                                            name ? name : Py_None, pass ? pass : k_forward,
                                            Py_None, zero, device, ckey);
            Py_XDECREF(ckey);
            if (group == NULL) {
                Py_DECREF(d);
                return NULL;
            }
            steps = PyDict_GetItemWithError(groups, group);
            if (steps == NULL && !PyErr_Occurred()) {
                PyObject *fresh = PyDict_New();
                int bad = fresh == NULL || PyDict_SetItem(groups, group, fresh) < 0;
                Py_XDECREF(fresh);
                steps = bad ? NULL : PyDict_GetItemWithError(groups, group);
            }
            else if (steps != NULL && !PyDict_CheckExact(steps)) {
                dup = 1; /* not FirstCopies' own form: leave it to the Python loop */
            }
            if (steps == NULL) {
                Py_DECREF(group);
                Py_DECREF(d);
                return NULL;
            }
            Py_INCREF(steps);
            if (!dup && cache != Py_None) {
                PyObject *entry = PyTuple_Pack(2, group, steps);
                int bad = entry == NULL || PyDict_SetItem(cache, device, entry) < 0;
                Py_XDECREF(entry);
                if (bad) {
                    Py_DECREF(group);
                    Py_DECREF(steps);
                    Py_DECREF(d);
                    return NULL;
                }
            }
            Py_DECREF(group);
        }
        PyObject *line = NULL;
        if (!dup) {
            int has = step == NULL ? -1 : PyDict_Contains(steps, step);
            if (has < 0) {
                if (step == NULL) {
                    PyErr_SetString(PyExc_TypeError, "validate_run: a record without step");
                }
                Py_DECREF(steps);
                Py_DECREF(d);
                return NULL;
            }
            dup = has;
        }
        if (!dup) {
            line = PyLong_FromSsize_t(first_line + k);
            if (line == NULL || PyDict_SetItem(steps, step, line) < 0) {
                Py_XDECREF(line);
                Py_DECREF(steps);
                Py_DECREF(d);
                return NULL;
            }
            Py_DECREF(line);
        }
        Py_DECREF(steps);
        Py_DECREF(d);
        if (dup) {
            break; /* a copy: the Python loop reports it */
        }
        taken++;
    }
    return Py_BuildValue("(nn)", k, taken);
}

static PyMethodDef methods[] = {
    {"plain_records", plain_records, METH_VARARGS, NULL},
    {"first_not_plain", first_not_plain, METH_VARARGS, NULL},
    {"time_keys", time_keys, METH_VARARGS, NULL},
    {"merge_round", merge_round, METH_VARARGS, NULL},
    {"per_device_run", per_device_run, METH_VARARGS, NULL},
    {"scalar_clean", scalar_clean, METH_VARARGS, NULL},
    {"validate_run", validate_run, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_speedups", "The reading loops of pmaptap.tapfile, in C.", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&k_name, "name"},         {&k_step, "step"},
        {&k_kind, "kind"},         {&k_run, "run"},
        {&k_process, "process"},   {&k_value, "value"},
        {&k_dtype, "dtype"},       {&k_shape, "shape"},
        {&k_time, "time"},         {&k_host, "host"},
        {&k_index, "index"},       {&k_pass, "pass"},
        {&k_vhash, "vhash"},       {&k_attempt, "attempt"},
        {&k_devices, "devices"},   {&k_processes, "processes"},
        {&k_device, "device"},     {&k_coords, "coords"},
        {&k_replicas, "replicas"}, {&k_per_device, "per_device"},
        {&k_replicated, "replicated"}, {&k_meta, "meta"},
        {&k_why, "why"},          {&k_forward, "forward"},
        {&k_divergent, "divergent"}, {&k_float, "float"},
        {&k_bfloat, "bfloat"},
    };
    for (size_t j = 0; j < sizeof(names) / sizeof(names[0]); j++) {
        *names[j].slot = PyUnicode_InternFromString(names[j].text);
        if (*names[j].slot == NULL) {
            return NULL;
        }
    }
    zero = PyLong_FromLong(0);
    if (zero == NULL) {
        return NULL;
    }
    for (int ch = 0; ch < 256; ch++) {
        plain_byte[ch] = ch >= 0x20 && ch < 0x7f && ch != '"' && ch != '\\';
    }
    return PyModule_Create(&module);
}
