/* router._native.kv_cost_scan: the C twin of router/policy/kv_cost.py's
 * KVCostPolicy.score over every candidate, without making a Score object per candidate
 * (the policy makes those only when a caller reads them). The same float operations
 * in the same order, so totals, and therefore ties and choices, are bit-identical to
 * the pure path's (setup.py compiles with -ffp-contract=off: no fused multiply-adds);
 * tests hold the two equal.
 *
 * kv_cost_scan(candidates, matches, loads, transfers, params)
 *     -> (tied, deepest, columns)
 *
 * ``matches`` and ``loads`` are dicts keyed by the candidates (absent: no match, no
 * load); ``transfers`` a dict of candidate -> transfer tokens, or None. ``params`` is
 * (block_size, prompt_tokens, cap, per_queued, per_uncached, per_decode_block,
 * offload_discount, disk_extra, waiting_weight, running_weight, kv_usage_weight,
 * fresh_after or None). ``tied`` lists the positions whose total is within 1e-9 of
 * the lowest, ``deepest`` is the largest match depth, and ``columns`` is bytes of
 * 8 doubles per candidate: matched blocks, cached tokens, queue, prefill, decode,
 * reported, total, transfer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define COLUMNS 8

static PyObject *s_blocks, *s_offloaded, *s_disk, *s_prefill_tokens, *s_decode_blocks,
    *s_reported_at, *s_waiting, *s_running, *s_kv_usage;

/* an int attribute of ``obj`` as a long long; -1 with an exception set on error */
static int
attr_ll(PyObject *obj, PyObject *name, long long *out)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) {
        return -1;
    }
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* a number attribute as a double, None (or falsy 0) as 0.0; *present: not None */
static int
attr_num(PyObject *obj, PyObject *name, double *out, int *present)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) {
        return -1;
    }
    if (v == Py_None) {
        *out = 0.0;
        if (present) {
            *present = 0;
        }
        Py_DECREF(v);
        return 0;
    }
    *out = PyFloat_AsDouble(v);
    Py_DECREF(v);
    if (present) {
        *present = 1;
    }
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

static PyObject *
kv_cost_scan(PyObject *module, PyObject *args)
{
    PyObject *cands_obj, *matches, *loads, *transfers;
    long long bs, isl, cap;
    double per_queued, per_uncached, per_decode, offload_discount, disk_extra, ww, wr, wk;
    PyObject *fresh_obj;
    if (!PyArg_ParseTuple(args, "OO!O!O(LLLddddddddO):kv_cost_scan", &cands_obj, &PyDict_Type,
                          &matches, &PyDict_Type, &loads, &transfers, &bs, &isl, &cap,
                          &per_queued, &per_uncached, &per_decode, &offload_discount,
                          &disk_extra, &ww, &wr, &wk, &fresh_obj)) {
        return NULL;
    }
    if (transfers != Py_None && !PyDict_Check(transfers)) {
        PyErr_SetString(PyExc_TypeError, "transfers must be a dict or None");
        return NULL;
    }
    const int reports = fresh_obj != Py_None;
    double fresh_after = 0.0;
    if (reports) {
        fresh_after = PyFloat_AsDouble(fresh_obj);
        if (fresh_after == -1.0 && PyErr_Occurred()) {
            return NULL;
        }
    }
    const int transferring = transfers != Py_None && PyDict_GET_SIZE(transfers) > 0;
    PyObject *cands = PySequence_Fast(cands_obj, "candidates must be a sequence");
    if (cands == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(cands);
    PyObject **items = PySequence_Fast_ITEMS(cands);
    PyObject *columns = PyBytes_FromStringAndSize(NULL, (n ? n : 1) * COLUMNS * (Py_ssize_t)sizeof(double));
    if (columns == NULL) {
        Py_DECREF(cands);
        return NULL;
    }
    double *col = (double *)PyBytes_AS_STRING(columns);
    double best = Py_HUGE_VAL;
    long long deepest = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *engine = items[i];
        long long blocks = 0, cached = 0;
        PyObject *match = PyDict_GetItemWithError(matches, engine);
        if (match == NULL && PyErr_Occurred()) {
            goto fail;
        }
        if (match != NULL) {
            long long offloaded, disk;
            if (attr_ll(match, s_blocks, &blocks) != 0 || attr_ll(match, s_offloaded, &offloaded) != 0) {
                goto fail;
            }
            double held = (double)blocks;
            if (offloaded) {
                held -= (double)offloaded * offload_discount;
                if (attr_ll(match, s_disk, &disk) != 0) {
                    goto fail;
                }
                if (disk) {
                    held -= (double)disk * disk_extra;
                }
            }
            cached = (long long)(held * (double)bs + 1e-6); /* int() truncates alike */
            if (cached > cap) {
                cached = cap;
            }
        }
        double prefill = per_uncached * (double)(isl - cached);
        double transfer = 0.0;
        if (transferring) {
            PyObject *t = PyDict_GetItemWithError(transfers, engine);
            if (t == NULL && PyErr_Occurred()) {
                goto fail;
            }
            double tokens = 0.0;
            if (t != NULL) {
                tokens = PyFloat_AsDouble(t);
                if (tokens == -1.0 && PyErr_Occurred()) {
                    goto fail;
                }
            }
            transfer = per_uncached * tokens;
        }
        double queue = 0.0, decode = 0.0, reported = 0.0, total;
        PyObject *load = PyDict_GetItemWithError(loads, engine);
        if (load == NULL && PyErr_Occurred()) {
            goto fail;
        }
        if (load == NULL) {
            total = prefill + transfer;
        } else {
            long long prefill_tokens, decode_blocks;
            if (attr_ll(load, s_prefill_tokens, &prefill_tokens) != 0 ||
                attr_ll(load, s_decode_blocks, &decode_blocks) != 0) {
                goto fail;
            }
            queue = per_queued * (double)prefill_tokens;
            decode = per_decode * (double)decode_blocks;
            if (reports) {
                double at;
                int present;
                if (attr_num(load, s_reported_at, &at, &present) != 0) {
                    goto fail;
                }
                if (present && at >= fresh_after) {
                    double waiting, running, usage;
                    if (attr_num(load, s_waiting, &waiting, NULL) != 0 ||
                        attr_num(load, s_running, &running, NULL) != 0 ||
                        attr_num(load, s_kv_usage, &usage, NULL) != 0) {
                        goto fail;
                    }
                    reported = ww * waiting + wr * running + wk * usage;
                }
            }
            total = queue + prefill + decode + reported + transfer;
        }
        double *row = col + i * COLUMNS;
        row[0] = (double)blocks;
        row[1] = (double)cached;
        row[2] = queue;
        row[3] = prefill;
        row[4] = decode;
        row[5] = reported;
        row[6] = total;
        row[7] = transfer;
        if (total < best) {
            best = total;
        }
        if (blocks > deepest) {
            deepest = blocks;
        }
    }
    PyObject *tied = PyList_New(0);
    if (tied == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (col[i * COLUMNS + 6] - best <= 1e-9) {
            PyObject *at = PyLong_FromSsize_t(i);
            if (at == NULL || PyList_Append(tied, at) != 0) {
                Py_XDECREF(at);
                Py_DECREF(tied);
                goto fail;
            }
            Py_DECREF(at);
        }
    }
    Py_DECREF(cands);
    return Py_BuildValue("(NLN)", tied, deepest, columns);
fail:
    Py_DECREF(columns);
    Py_DECREF(cands);
    return NULL;
}

static PyMethodDef cost_methods[] = {
    {"kv_cost_scan", kv_cost_scan, METH_VARARGS,
     "kv_cost_scan(candidates, matches, loads, transfers, params) -> (tied, deepest, columns)"},
    {NULL, NULL, 0, NULL},
};

int
kvroute_add_cost_functions(PyObject *module)
{
    PyObject **names[] = {&s_blocks,  &s_offloaded, &s_disk,   &s_prefill_tokens, &s_decode_blocks,
                          &s_reported_at, &s_waiting, &s_running, &s_kv_usage};
    const char *text[] = {"blocks",      "offloaded", "disk",    "prefill_tokens", "decode_blocks",
                          "reported_at", "waiting",   "running", "kv_usage"};
    for (size_t k = 0; k < sizeof(names) / sizeof(names[0]); k++) {
        *names[k] = PyUnicode_InternFromString(text[k]);
        if (*names[k] == NULL) {
            return -1;
        }
    }
    return PyModule_AddFunctions(module, cost_methods);
}
